"""ONNX external data (SPEC §11: encoders over 2 GB): exercised on the tiny checkpoint with a forced threshold.

No real-size tower here crosses protobuf's 2 GiB limit in fp32 (XLM-R-base's text encoder is
~1.1 GB, docs/models.md), so the path a larger model takes — ``NAME.onnx`` + ``NAME.onnx.data``
in the bundle, checksummed, loaded by the service — runs here with the threshold set to 1 byte.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from index.runtime.loader import LoadedBundle
from index.runtime.verify import verify_bundle
from training.bundle import onnx_export


@pytest.fixture(scope="module")
def external_bundle(tiny_checkpoint: Path, tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.bundle.export import export_bundle

    patch = pytest.MonkeyPatch()
    patch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 1)
    try:
        return export_bundle(tiny_checkpoint, manifest=tiny_corpus, out_dir=tmp_path_factory.mktemp("external"),
                             progress=False, quantize_text=False)
    finally:
        patch.undo()


def test_weights_go_to_one_data_file_per_encoder(external_bundle: Path) -> None:
    manifest = verify_bundle(external_bundle)  # checksums cover the .data files, ONNX loads from them
    for name in ("audio_encoder.onnx", "text_encoder.onnx"):
        data = external_bundle / f"{name}.data"
        assert data.is_file() and data.stat().st_size > (external_bundle / name).stat().st_size
        assert f"{name}.data" in manifest.files
    assert not [p for p in external_bundle.rglob("*") if p.name.startswith(".")]  # no scratch left behind


def test_external_data_bundle_gives_the_same_embeddings(external_bundle: Path, tiny_bundle: Path) -> None:
    a, b = LoadedBundle.open(external_bundle), LoadedBundle.open(tiny_bundle)
    wave = 0.1 * np.random.default_rng(0).standard_normal(a.clip_samples).astype(np.float32)
    np.testing.assert_allclose(a.encode_audio([wave]), b.encode_audio([wave]), atol=1e-5)
    np.testing.assert_allclose(a.encode_text(["un chien aboie"]), b.encode_text(["un chien aboie"]), atol=1e-5)


def test_copy_model_keeps_external_data(tmp_path: Path, external_bundle: Path) -> None:
    from training.bundle.onnx_export import copy_model, onnx_session

    copy_model(external_bundle / "text_encoder.onnx", tmp_path / "copy.onnx")
    assert (tmp_path / "copy.onnx.data").is_file()
    ids = np.ones((1, 8), np.int64)
    out = onnx_session(tmp_path / "copy.onnx").run(None, {"input_ids": ids, "attention_mask": ids})[0]
    assert out.shape[0] == 1 and np.isfinite(out).all()
