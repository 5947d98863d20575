"""Evaluation: chunk averaging by hand, a perfect and a shifted fake encoder, the CLI outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import TINY_CONFIG
from tonearm.cli import main
from training.config import load_train_config
from training.data.dataset import eval_audio_chunks, eval_captions
from training.data.manifest import load_manifest
from training.evaluate import clip_samples, embed_chunks, evaluate_model


class FirstSamples(nn.Module):
    """encode_audio = the first two samples of each chunk (not normalized)."""

    embed_dim = 2

    def encode_audio(self, waveform: torch.Tensor) -> torch.Tensor:
        return waveform[:, :2]


def test_embed_chunks_averages_then_normalizes() -> None:
    chunks = [
        np.array([[1.0, 0.0, 9.0], [0.0, 1.0, 9.0]], np.float32),  # mean (0.5, 0.5)
        np.array([[3.0, 4.0, 9.0]], np.float32),
        np.array([[0.0, -2.0, 9.0], [0.0, -4.0, 9.0], [0.0, -6.0, 9.0]], np.float32),
    ]
    emb = embed_chunks(FirstSamples(), chunks, batch_size=2, device=torch.device("cpu"))
    expected = torch.tensor([[math.sqrt(0.5), math.sqrt(0.5)], [0.6, 0.8], [0.0, -1.0]])
    assert torch.allclose(emb, expected, atol=1e-6)


class OracleEncoder(nn.Module):
    """Knows which clip each chunk and each caption belongs to; `shift` maps captions to another clip."""

    def __init__(
        self, chunk_owner: dict[bytes, int], caption_clip: np.ndarray, n_clips: int, shift: int
    ) -> None:
        super().__init__()
        self.chunk_owner, self.caption_clip = chunk_owner, caption_clip
        self.embed_dim, self.shift = n_clips, shift

    def encode_audio(self, waveform: torch.Tensor) -> torch.Tensor:
        owners = torch.tensor([self.chunk_owner[row.numpy().tobytes()] for row in waveform])
        return F.one_hot(owners, self.embed_dim).float()

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        clips = (
            torch.from_numpy(self.caption_clip[input_ids[:, 0].numpy()]) + self.shift
        ) % self.embed_dim
        return F.one_hot(clips, self.embed_dim).float()


class NumberingTokenizer:
    """Gives the i-th caption it ever encodes the token id i (evaluation encodes each query once, in order)."""

    def __init__(self) -> None:
        self.seen = 0

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.arange(self.seen, self.seen + len(texts), dtype=np.int64)[:, None]
        self.seen += len(texts)
        return ids, np.ones_like(ids)


@pytest.mark.parametrize(("shift", "recall"), [(0, 1.0), (1, 0.0)])
def test_evaluate_model_with_oracle_encoders(tiny_corpus: Path, shift: int, recall: float) -> None:
    tiny = load_train_config(TINY_CONFIG)
    data_cfg, frontend_cfg = tiny.data, tiny.frontend
    records = load_manifest(tiny_corpus, languages=data_cfg.languages, split="test")
    owner = {}
    for index, record in enumerate(records):
        chunks = eval_audio_chunks(
            record,
            sample_rate=16000,
            clip_samples=clip_samples(data_cfg, frontend_cfg),
            policy=data_cfg.eval_crop,
        )
        owner.update({chunk.tobytes(): index for chunk in chunks})
    captions = eval_captions(records, tuple(data_cfg.languages))
    model = OracleEncoder(owner, np.asarray(captions.clip), len(records), shift)
    report = evaluate_model(
        model,
        NumberingTokenizer(),
        records,
        data_cfg=data_cfg,
        frontend_cfg=frontend_cfg,
        batch_size=5,
        device="cpu",
    )
    assert report["n_clips"] == len(records) and report["n_captions"] == len(captions.texts)
    for lang in data_cfg.languages:
        assert report[f"t2a_R@1_{lang}"] == recall
        assert report[f"a2t_R@1_{lang}"] == recall
    if shift == 0:
        assert report["mrv_t2a"] == 0.0 and report["t2a_mAP@10_mean"] == 1.0


def test_cli_evaluate_writes_reports(
    tiny_checkpoint: Path, tiny_corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "eval"
    assert (
        main(
            [
                "evaluate",
                str(tiny_checkpoint),
                "--data",
                str(tiny_corpus),
                "--split",
                "test",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    assert report["split"] == "test" and "convention" in report
    metrics = report["metrics"]
    assert 0.0 <= metrics["t2a_R@10_mean"] <= 1.0 and 0.0 <= metrics["a2t_R@1_eng"] <= 1.0
    assert "| eng |" in (out / "report.md").read_text() or "eng" in (out / "report.md").read_text()
    assert (out / "languages.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_evaluate_bad_input(
    tiny_checkpoint: Path, tiny_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["evaluate", str(tiny_checkpoint), "--data", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    assert (
        main(["evaluate", str(tiny_checkpoint), "--data", str(tiny_corpus), "--split", "nosuch"])
        == 2
    )
    assert "nosuch" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "no-checkpoint"), "--data", str(tiny_corpus)]) == 2
