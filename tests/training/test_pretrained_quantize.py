"""`tonearm export --pretrained --quantize text|audio|both`: int8 encoders in the bundle, recorded in the
manifest and measured against fp32 on the held-out set, as for trained bundles (training.bundle.quantize).

A small random ``ClapModel`` (0.37 M parameters) keeps this cheap; the full-size CLAP's fp32 path is
tests/training/test_real_size_pretrained.py.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from index.bundle import format as fmt
from index.runtime.loader import LoadedBundle
from tests.real_size_models import bpe_tokenizer
from tonearm.cli import main


@pytest.fixture(scope="module")
def small_clap_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_clap(tmp_path_factory.mktemp("small_clap"))


def write_small_clap(directory: Path) -> Path:
    """A small random-weight ClapModel folder (HTS-AT 1-1-1-1, one text layer) with tokenizer and extractor."""
    import torch
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel

    torch.manual_seed(0)
    directory.mkdir(parents=True, exist_ok=True)
    config = ClapConfig(
        audio_config={"depths": [1, 1, 1, 1], "num_attention_heads": [1, 1, 1, 1], "patch_embeds_hidden_size": 16,
                          "hidden_size": 128, "projection_dim": 32},
        text_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                         "projection_dim": 32, "vocab_size": 700},
        projection_dim=32,
    )
    ClapModel(config).save_pretrained(directory)
    bpe_tokenizer(directory, roberta_ids=True, max_length=64)
    ClapFeatureExtractor(truncation="rand_trunc", padding="repeatpad", frequency_min=50,
                         frequency_max=14000).save_pretrained(directory)
    return directory


def ops(path: Path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}


@pytest.mark.parametrize("choice", ["both", "text"])
def test_quantized_pretrained_bundle_is_recorded_and_measured(
    small_clap_dir: Path, real_manifest: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], choice: str
) -> None:
    out = tmp_path / "bundles"
    code = main(["export", "--pretrained", str(small_clap_dir), "--data", str(real_manifest), "--out", str(out),
                 "--quantize", choice, "--quantize-on-loss", "warn"])
    assert code == 0, capsys.readouterr().err
    (path,) = [p for p in out.iterdir() if p.is_dir()]
    manifest = fmt.read_manifest(path)
    quantized = {"both": {"audio", "text"}, "text": {"text"}}[choice]
    assert manifest.audio_encoder.quantization == ("dynamic-int8" if "audio" in quantized else "none")
    assert manifest.text_encoder.quantization == "dynamic-int8"
    q = manifest.quantization
    assert q is not None and set(q.encoders) == quantized and set(q.agreement) == quantized
    for agreement in q.agreement.values():
        assert 0.0 < agreement.min_cosine <= agreement.mean_cosine <= 1.0 + 1e-6 and agreement.items > 0
    assert manifest.evaluation.fp32_text_report and manifest.evaluation.quantization_delta is not None
    assert "MatMulInteger" in ops(path / fmt.TEXT_ENCODER)
    assert ("MatMulInteger" in ops(path / fmt.AUDIO_ENCODER)) == ("audio" in quantized)
    loaded = LoadedBundle.open(path)
    try:
        assert loaded.manifest.bundle_id == manifest.bundle_id
    finally:
        loaded.close()
