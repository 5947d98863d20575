"""Correspondence distillation (SPEC §4.4): one-hot targets = L_sup; ensembled soft targets; mix."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from training.config import ConfigError, ObjectiveConfig
from training.objectives.base import AlignedPair, BuildEnv, EmbeddingBatch
from training.objectives.distill import distillation_loss, ensemble_similarity, soft_targets
from training.objectives.registry import build_objective

ENV = BuildEnv(languages=("eng",), embed_dim=8)


def unit(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)


def infonce(left: torch.Tensor, right: torch.Tensor, tau: float) -> torch.Tensor:
    logits = left @ right.t() / tau
    target = torch.arange(left.shape[0])
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))


def distill_objective(**distill: object):
    spec = {"teachers": ["runs/a/best"], **distill}
    return build_objective(
        ObjectiveConfig(base={"name": "infonce", "tau": 0.05, "learnable_tau": False}, distill=spec), ENV
    ).double()


def test_one_hot_targets_give_the_supervised_loss() -> None:
    audio, text = unit(6, 8, seed=0), unit(6, 8, seed=1)
    eye = torch.eye(6, dtype=torch.float64)
    logits = audio @ text.t() / 0.05
    assert torch.allclose(distillation_loss(logits, eye, eye), infonce(audio, text, 0.05))


def test_targets_are_softmaxes_of_the_mean_teacher_similarity() -> None:
    left, right = unit(3, 5, 8, seed=2), unit(3, 5, 8, seed=3)  # M = 3 teachers
    tau = 0.05
    target_a, target_c = soft_targets(ensemble_similarity(left, right), tau)
    sims = np.mean([left[m].numpy() @ right[m].numpy().T for m in range(3)], axis=0)
    exp = np.exp(sims / tau)
    assert np.allclose(target_c.numpy(), exp / exp.sum(axis=1, keepdims=True))  # captions given an audio
    assert np.allclose(target_a.numpy(), exp / exp.sum(axis=0, keepdims=True))  # audios given a caption


def test_cross_entropy_by_hand_on_two_items() -> None:
    logits = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    target = torch.tensor([[0.75, 0.5], [0.25, 0.5]], dtype=torch.float64)  # columns sum to 1
    log_q_a = [[1 - math.log(math.e + 1), -math.log(1 + math.e**2)], [-math.log(math.e + 1), 2 - math.log(1 + math.e**2)]]
    h_a = -(0.75 * log_q_a[0][0] + 0.25 * log_q_a[1][0] + 0.5 * log_q_a[0][1] + 0.5 * log_q_a[1][1]) / 2
    row_target = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    h_c = -(1 - math.log(math.e + 1) + 2 - math.log(1 + math.e**2)) / 2
    assert distillation_loss(logits, target, row_target).item() == pytest.approx(0.5 * (h_a + h_c))


def test_confident_identical_teachers_make_distillation_match_infonce() -> None:
    """Teachers whose similarity is the identity give (numerically) one-hot targets at τ = 0.05."""
    audio, text = unit(5, 8, seed=4), unit(5, 8, seed=5)
    basis = torch.eye(5, 8, dtype=torch.float64)
    pair = AlignedPair(
        left=audio, right=text, clip_index=torch.arange(5), kind="audio-text", weight=1.0, name="p",
        teacher_left=basis[None], teacher_right=basis[None],
    )
    out = distill_objective().base(pair)
    assert set(out) == {"distill_loss"}  # λ = 0: the base is not computed
    assert torch.allclose(out["distill_loss"], infonce(audio, text, 0.05), atol=1e-6)


def test_mix_lambda_weights_base_and_distillation() -> None:
    audio, text = unit(5, 8, seed=6), unit(5, 8, seed=7)
    t_left, t_right = unit(2, 5, 8, seed=8), unit(2, 5, 8, seed=9)
    pair = AlignedPair(
        left=audio, right=text, clip_index=torch.arange(5), kind="audio-text", weight=1.0, name="p",
        teacher_left=t_left, teacher_right=t_right,
    )
    out = distill_objective(mix_lambda=0.3).base(pair)
    target_a, target_c = soft_targets(ensemble_similarity(t_left, t_right), 0.05)
    dist = distillation_loss(audio @ text.t() / 0.05, target_a, target_c)
    assert torch.allclose(out["infonce_loss"], 0.3 * infonce(audio, text, 0.05))
    assert torch.allclose(out["distill_loss"], 0.7 * dist)
    assert out["tau"].item() == pytest.approx(0.05)  # logged values are not scaled


def test_objective_uses_teacher_embeddings_of_the_batch_views() -> None:
    objective = distill_objective()
    audio, text = unit(4, 8, seed=10), unit(1, 4, 8, seed=11)
    t_audio, t_text = unit(2, 4, 8, seed=12), unit(2, 1, 4, 8, seed=13)
    batch = EmbeddingBatch(
        audio=audio, text=text, text_mask=torch.ones(1, 4, dtype=torch.bool), clip_index=torch.arange(4),
        teacher_audio=t_audio, teacher_text=t_text,
    )
    target_a, target_c = soft_targets(ensemble_similarity(t_audio, t_text[:, 0]), 0.05)
    expected = distillation_loss(audio @ text[0].t() / 0.05, target_a, target_c)
    assert torch.allclose(objective(batch)["distill_loss"], expected)


def test_missing_teacher_embeddings_is_an_explicit_error() -> None:
    batch = EmbeddingBatch(
        audio=unit(4, 8, seed=14), text=unit(1, 4, 8, seed=15),
        text_mask=torch.ones(1, 4, dtype=torch.bool), clip_index=torch.arange(4),
    )
    with pytest.raises(RuntimeError, match="teacher"):
        distill_objective()(batch)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"teachers": []}, "teachers"),
        ({"teachers": ["a"], "mix_lambda": 1.5}, "mix_lambda"),
        ({"teachers": ["a"], "cache": "sometimes"}, "cache"),
        ({"teachers": ["a"], "temperature": 0.1}, "unknown key"),
    ],
)
def test_bad_distill_sections_are_config_errors(spec: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_objective(ObjectiveConfig(distill=spec), ENV)


# --- teachers (real checkpoints from the session fixtures) -------------------------------------


def teacher_batch(waveform: torch.Tensor, texts: list[list[str | None]]):
    """A training batch as TrainCollate makes it (only the fields teachers read are filled for real)."""
    from training.data.dataset import TrainBatch

    views, size = len(texts), waveform.shape[0]
    return TrainBatch(
        waveform=waveform, input_ids=torch.zeros(views, size, 4, dtype=torch.long),
        attention_mask=torch.ones(views, size, 4, dtype=torch.long),
        text_mask=torch.tensor([[t is not None for t in view] for view in texts]),
        clip_index=torch.arange(size), texts=texts,
    )


def teachers_for(checkpoint: Path, *, count: int, cache: str):
    from training.config import DataConfig, FrontendConfig
    from training.teachers import build_teachers

    return build_teachers(
        {"teachers": [checkpoint] * count, "cache": cache}, device="cpu", train_records=[], tokenizer=None,
        frontend=FrontendConfig(), data=DataConfig(),
    )


def test_teachers_embed_like_their_checkpoint(tiny_checkpoint: Path) -> None:
    from training.checkpoint import load_checkpoint

    teachers = teachers_for(tiny_checkpoint, count=2, cache="off")
    waveform = 0.1 * torch.randn(3, 16000, generator=torch.Generator().manual_seed(0))
    texts = [["a dog barks", None, "rain falls"], ["un chien aboie", "x", "la pluie"]]
    audio, text = teachers.embed(teacher_batch(waveform, texts))

    reference = load_checkpoint(tiny_checkpoint)
    dim = reference.model.embed_dim
    assert audio.shape == (2, 3, dim) and text.shape == (2, 2, 3, dim)
    with torch.no_grad():
        expected_audio = reference.model.eval().encode_audio(waveform)
        ids, mask = reference.tokenizer.encode(["a dog barks", "rain falls"])
        expected_text = reference.model.encode_text(torch.as_tensor(ids), torch.as_tensor(mask))
    assert torch.allclose(audio[0], expected_audio, atol=1e-5) and torch.allclose(audio[1], audio[0])
    assert torch.allclose(text[0, 0, 0], expected_text[0], atol=1e-5)
    assert torch.allclose(text[1, 0, 2], expected_text[1], atol=1e-5)
    assert torch.count_nonzero(text[:, 0, 1]) == 0  # a missing caption embeds as zeros
    assert all(not p.requires_grad for t in teachers.teachers for p in t.model.parameters())


@pytest.mark.parametrize("cache", ["on", "off"])
def test_teacher_audio_is_cached_per_clip_only_when_caching(tiny_checkpoint: Path, cache: str) -> None:
    teachers = teachers_for(tiny_checkpoint, count=1, cache=cache)
    g = torch.Generator().manual_seed(1)
    texts = [["a", "b"]]
    first, _ = teachers.embed(teacher_batch(0.1 * torch.randn(2, 16000, generator=g), texts))
    second, _ = teachers.embed(teacher_batch(0.1 * torch.randn(2, 16000, generator=g), texts))  # other crops
    assert torch.equal(first, second) == (cache == "on")


def test_teachers_must_share_the_student_sample_rate(tiny_checkpoint: Path) -> None:
    from training.config import DataConfig, FrontendConfig
    from training.teachers import build_teachers

    with pytest.raises(ConfigError, match="Hz"):
        build_teachers(
            {"teachers": [tiny_checkpoint]}, device="cpu", train_records=[], tokenizer=None,
            frontend=FrontendConfig(sample_rate=22050), data=DataConfig(),
        )


@pytest.mark.parametrize("padding", ["frames", "reflect"])
def test_a_teacher_that_cannot_read_the_students_nan_tail_is_refused(tiny_checkpoint: Path, padding: str) -> None:
    """An AST (``frames``) or PE-Audio (``reflect``) student's batches end short clips with NaN; the tiny
    CNN teacher zero-pads and would embed NaN (found by reading Teachers._encode_audio, issue 41)."""
    from training.config import DataConfig, FrontendConfig
    from training.teachers import build_teachers

    with pytest.raises(ConfigError, match="NaN"):
        build_teachers(
            {"teachers": [tiny_checkpoint]}, device="cpu", train_records=[], tokenizer=None,
            frontend=FrontendConfig(short_clip_padding=padding), data=DataConfig(),
        )


def test_auto_cache_rule_is_whether_the_crop_covers_every_clip(tmp_path: Path) -> None:
    import soundfile as sf

    from training.teachers import crop_covers_clips

    class Record:
        def __init__(self, seconds: float, rate: int) -> None:
            self.audio = tmp_path / f"{seconds}-{rate}.wav"
            sf.write(self.audio, np.zeros(int(seconds * rate), dtype=np.float32), rate)

    short = [Record(1.0, 16000), Record(2.0, 44100)]
    assert crop_covers_clips(short, clip_seconds=2.0)
    assert not crop_covers_clips([*short, Record(2.5, 16000)], clip_seconds=2.0)


def test_distillation_trains_end_to_end_from_a_teacher(tiny_corpus: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:
    import json

    from tonearm.cli import main

    out_dir = tmp_path / "student"
    code = main([
        "train", str(Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"), f"data.manifest={tiny_corpus}", f"out_dir={out_dir}", "optim.max_steps=3",
        "optim.epochs=1", f"model.init_checkpoint={tiny_checkpoint}",
        f"objective.distill={{teachers: [{tiny_checkpoint}, {tiny_checkpoint}], mix_lambda: 0.5}}",
    ])
    assert code == 0
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    first = next(r for r in records if r["kind"] == "step")
    assert {"distill_loss", "infonce_loss"} <= set(first) and math.isfinite(first["loss"])
