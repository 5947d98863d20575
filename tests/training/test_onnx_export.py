"""ONNX export: onnxruntime agrees with PyTorch (cosine ≥ 0.999 per item, SPEC §6)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from index.bundle.tokenizer import TextTokenizer
from tests.index.test_tokenizer import ALL_CAPTIONS, CAPTIONS, corpus
from training.bundle.onnx_export import (
    ExportError,
    export_audio_encoder,
    export_text_encoder,
    onnx_session,
)
from training.config import FrontendConfig, ModelConfig
from training.models.dual_encoder import DualEncoder, build_dual_encoder
from training.models.frontend import LogMelFrontend
from training.models.tokenizer import train_bpe_tokenizer

SR = 16000


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return train_bpe_tokenizer(corpus(), vocab_size=600, max_length=24)


@pytest.fixture(scope="module")
def model(tokenizer: TextTokenizer) -> DualEncoder:
    """The default-size model, with non-trivial BatchNorm statistics."""
    torch.manual_seed(0)
    model = build_dual_encoder(ModelConfig(), FrontendConfig(), vocab_size=tokenizer.vocab_size)
    model.train()
    with torch.no_grad():
        model.encode_audio(0.1 * torch.randn(4, SR))
    return model.eval()


@pytest.fixture(scope="module")
def audio_onnx(model: DualEncoder, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_audio_encoder(
        model.audio_module(), tmp_path_factory.mktemp("onnx") / "audio.onnx", sample_rate=SR
    )


@pytest.fixture(scope="module")
def text_onnx(
    model: DualEncoder, tokenizer: TextTokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    path = tmp_path_factory.mktemp("onnx") / "text.onnx"
    return export_text_encoder(model.text_module(), path, max_length=tokenizer.max_length)


def scene(batch: int, seconds: float) -> np.ndarray:
    """Tones + noise, different per item (deterministic)."""
    rng = np.random.default_rng(int(seconds * 10) + batch)
    t = np.arange(int(seconds * SR)) / SR
    tones = [
        np.sin(2 * math.pi * (200 + 900 * i) * t) * (0.5 + 0.5 * np.sin(3 * t + i))
        for i in range(batch)
    ]
    return (0.3 * np.stack(tones) + 0.05 * rng.standard_normal((batch, t.size))).astype(np.float32)


def test_signatures_and_opset(audio_onnx: Path, text_onnx: Path) -> None:
    audio, text = onnx.load(str(audio_onnx)), onnx.load(str(text_onnx))
    assert max(o.version for o in audio.opset_import if o.domain in ("", "ai.onnx")) >= 18
    names = lambda values: [v.name for v in values]  # noqa: E731
    assert names(audio.graph.input) == ["waveform"] and names(audio.graph.output) == ["embedding"]
    assert names(text.graph.input) == ["input_ids", "attention_mask"]
    assert names(text.graph.output) == ["embedding"]
    dims = [d.dim_param for d in audio.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "samples"]
    assert text.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT64


@pytest.mark.parametrize("seconds", [1.0, 5.0, 7.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_audio_parity(model: DualEncoder, audio_onnx: Path, seconds: float, batch: int) -> None:
    wave = scene(batch, seconds)
    with torch.no_grad():
        expected = model.encode_audio(torch.from_numpy(wave)).numpy()
    got = onnx_session(audio_onnx).run(["embedding"], {"waveform": wave})[0]
    assert got.shape == (batch, 256) and got.dtype == np.float32
    assert cosines(got, expected).min() >= 0.999


@pytest.mark.parametrize("lang", sorted(CAPTIONS))
def test_text_parity_in_every_language(
    model: DualEncoder, tokenizer: TextTokenizer, text_onnx: Path, lang: str
) -> None:
    texts = [
        *CAPTIONS[lang],
        CAPTIONS[lang][0][:3],
        " ".join(ALL_CAPTIONS),
    ]  # short, long (truncated)
    ids, mask = tokenizer.encode(texts)
    assert mask[-1].all()  # the long one really is truncated
    with torch.no_grad():
        expected = model.encode_text(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    got = onnx_session(text_onnx).run(["embedding"], {"input_ids": ids, "attention_mask": mask})[0]
    assert cosines(got, expected).min() >= 0.999
    one = onnx_session(text_onnx).run(
        ["embedding"], {"input_ids": ids[:1], "attention_mask": mask[:1]}
    )[0]
    assert cosines(one, expected[:1]).min() >= 0.999


class _Frontend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frontend = LogMelFrontend(FrontendConfig())

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        return self.frontend(waveform).flatten(1)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_frontend_features_match_in_onnxruntime(tmp_path: Path) -> None:
    """The exported frontend (DFT as conv1d) reproduces training's torch.stft log-mel."""
    module = _Frontend().eval()
    path = tmp_path / "frontend.onnx"
    torch.onnx.export(
        module,
        (torch.randn(1, SR),),
        str(path),
        input_names=["waveform"],
        output_names=["embedding"],
        dynamic_axes={"waveform": {0: "b", 1: "n"}, "embedding": {0: "b", 1: "f"}},
        opset_version=18,
        dynamo=False,
    )
    wave = scene(2, 1.3)
    got = onnx_session(path).run(None, {"waveform": wave})[0]
    with torch.no_grad():
        expected = module(torch.from_numpy(wave)).numpy()
    assert got.shape == expected.shape == (2, 64 * (1 + wave.shape[1] // 160))
    loud = expected > math.log(
        1e-3
    )  # where the log is not dominated by float rounding of tiny powers
    np.testing.assert_allclose(got[loud], expected[loud], atol=2e-3)


class _TracesDifferently(nn.Module):
    """Returns another function while being exported: the verification must catch it."""

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            return waveform[:, :4]
        return waveform[:, 4:8]


def test_a_wrong_export_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="disagree"):
        export_audio_encoder(_TracesDifferently(), tmp_path / "bad.onnx", sample_rate=SR)
