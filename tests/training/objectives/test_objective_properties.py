"""Properties every objective of Objectives I must have (STYLE "Tests", SPEC §4).

For each composed objective: invariant to jointly permuting the batch; lower for aligned
than for shuffled pairs; a few Adam steps on a toy batch lower it. And every YAML preset
under configs/ validates and builds its objective.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from training.config import ObjectiveConfig, load_train_config
from training.objectives.base import BuildEnv, EmbeddingBatch, Objective, total_loss
from training.objectives.registry import build_objective

LANGS = ("eng", "fra", "deu")
DIM = 16
SIZE = 8
CONFIGS = Path(__file__).resolve().parents[3] / "configs"

SVR_STATIC = {"name": "svr", "radius": "static"}
SVR_DYNAMIC = {"name": "svr", "radius": "dynamic", "width": 16}
OBJECTIVES: dict[str, dict] = {
    "infonce": {},
    "siglip": {"base": {"name": "siglip"}},
    "infonce_uni_static_svr": {"regularizers": [{**SVR_STATIC, "direction": "uni"}]},
    "infonce_bi_static_svr": {"regularizers": [SVR_STATIC]},
    "infonce_uni_dynamic_svr": {"regularizers": [{**SVR_DYNAMIC, "direction": "uni"}]},
    "infonce_bi_dynamic_svr": {"regularizers": [SVR_DYNAMIC]},
    "infonce_bi_dynamic_svr_wo_cons": {"regularizers": [{**SVR_DYNAMIC, "beta": 0.0}]},
    "siglip_bi_dynamic_svr": {"base": {"name": "siglip"}, "regularizers": [SVR_DYNAMIC]},
    "kcl": {"strategy": {"name": "kcl"}},
    "kcl_bi_static_svr": {"strategy": {"name": "kcl"}, "regularizers": [SVR_STATIC]},
    "cacl": {"strategy": {"name": "cacl"}},
    "siglip_cacl_bi_dynamic_svr": {
        "base": {"name": "siglip"}, "strategy": {"name": "cacl"}, "regularizers": [SVR_DYNAMIC],
    },
    "infonce_simple_reweight": {"base": {"name": "infonce_reweight", "init_gamma": 2.0}},
    "triplet_hardest": {"base": {"name": "triplet"}},
    "triplet_sum": {"base": {"name": "triplet", "negatives": "sum"}},
    "triplet_uwd": {"base": {"name": "triplet"}, "regularizers": [{"name": "uwd", "marginals": "variance"}]},
    "distill": {"distill": {"teachers": ["t1", "t2"]}},
    "distill_mix_cacl": {"strategy": {"name": "cacl"}, "distill": {"teachers": ["t1"], "mix_lambda": 0.5}},
}


def build(name: str) -> Objective:
    return build_objective(ObjectiveConfig(**OBJECTIVES[name]), BuildEnv(languages=LANGS, embed_dim=DIM)).double()


def toy_batch(objective: Objective, *, seed: int, noise: float = 0.3) -> EmbeddingBatch:
    """Audio, texts and teachers scattered around shared per-clip latents (aligned rows)."""
    g = torch.Generator().manual_seed(seed)
    views = objective.strategy.num_views
    latent = torch.randn(SIZE, DIM, generator=g, dtype=torch.float64)

    def around(*lead: int) -> torch.Tensor:
        return F.normalize(latent + noise * torch.randn(*lead, SIZE, DIM, generator=g, dtype=torch.float64), dim=-1)

    mask = torch.ones(views, SIZE, dtype=torch.bool)
    if views > 1:
        mask[-1, 0] = False  # one clip lacks a language
    return EmbeddingBatch(
        audio=around(), text=around(views), text_mask=mask, clip_index=torch.arange(SIZE) + 100,
        teacher_audio=around(2), teacher_text=around(2, views),
    )


def permuted(batch: EmbeddingBatch, order: torch.Tensor) -> EmbeddingBatch:
    return EmbeddingBatch(
        audio=batch.audio[order], text=batch.text[:, order], text_mask=batch.text_mask[:, order],
        clip_index=batch.clip_index[order], teacher_audio=batch.teacher_audio[:, order],
        teacher_text=batch.teacher_text[:, :, order],
    )


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_invariant_to_jointly_permuting_the_batch(name: str) -> None:
    objective = build(name)
    batch = toy_batch(objective, seed=1)
    order = torch.randperm(SIZE, generator=torch.Generator().manual_seed(2))
    original, shuffled = objective(batch), objective(permuted(batch, order))
    assert set(original) == set(shuffled)
    for key in original:
        assert torch.allclose(torch.as_tensor(original[key]), torch.as_tensor(shuffled[key]), atol=1e-10), key


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_lower_for_aligned_than_for_shuffled_pairs(name: str) -> None:
    objective = build(name)
    batch = toy_batch(objective, seed=3)
    roll = torch.roll(torch.arange(SIZE), 1)  # every text row moves to another clip
    misaligned = EmbeddingBatch(
        audio=batch.audio, text=batch.text[:, roll], text_mask=batch.text_mask[:, roll],
        clip_index=batch.clip_index, teacher_audio=batch.teacher_audio, teacher_text=batch.teacher_text,
    )
    assert total_loss(objective(batch)) < total_loss(objective(misaligned))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_a_few_adam_steps_lower_it(name: str) -> None:
    objective = build(name)
    batch = toy_batch(objective, seed=4, noise=2.0)
    audio = batch.audio.clone().requires_grad_(True)
    text = batch.text.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([audio, text, *objective.parameters()], lr=0.05)

    def loss() -> torch.Tensor:
        current = EmbeddingBatch(
            audio=F.normalize(audio, dim=-1), text=F.normalize(text, dim=-1), text_mask=batch.text_mask,
            clip_index=batch.clip_index, teacher_audio=batch.teacher_audio, teacher_text=batch.teacher_text,
        )
        return total_loss(objective(current))

    start = loss().item()
    for _ in range(15):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    assert loss().item() < start


def test_the_svr_epoch_summary_reaches_the_objective() -> None:
    objective = build("kcl_bi_static_svr")
    objective(toy_batch(objective, seed=5))
    assert objective.epoch_summary() == pytest.approx({"svr_mean_radius": 0.1})


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_preset_validates_and_builds_its_objective(path: Path) -> None:
    config = load_train_config(path)
    objective = build_objective(
        config.objective, BuildEnv(languages=tuple(config.data.languages), embed_dim=config.model.embed_dim)
    )
    assert isinstance(objective, Objective)


# --- end to end on the tiny corpus ------------------------------------------------------------

TINY = CONFIGS / "tiny.yaml"
END_TO_END: dict[str, list[str]] = {
    "uni_static_svr": ["objective.regularizers=[{name: svr, radius: static, direction: uni}]"],
    "siglip_bi_dynamic_svr": [
        "objective.base={name: siglip}", "objective.regularizers=[{name: svr, radius: dynamic}]",
    ],
    "kcl": ["objective.strategy={name: kcl}"],
    "simple_reweight": ["objective.base={name: infonce_reweight}"],
    "triplet_dart_l2norm": ["objective.base={name: triplet}", "objective.regularizers=[{name: uwd, marginals: l2norm}]"],
    "cacl_bi_dynamic_svr": [
        "objective.strategy={name: cacl}", "objective.regularizers=[{name: svr, radius: dynamic}]",
    ],
}
EXPECTED_TERMS = {
    "uni_static_svr": {"infonce_loss", "svr_loss"},
    "siglip_bi_dynamic_svr": {"siglip_loss", "svr_loss", "svr_cons_loss"},
    "kcl": {"infonce_loss"},
    "simple_reweight": {"reweight_loss", "gamma"},
    "triplet_dart_l2norm": {"triplet_loss", "uwd_loss"},
    "cacl_bi_dynamic_svr": {"infonce_loss", "svr_loss", "svr_cons_loss"},
}


def train_tiny(manifest: Path, out_dir: Path, overrides: list[str]) -> list[dict]:
    """`tonearm train configs/tiny.yaml` for 3 steps; returns the metrics.jsonl records."""
    from tonearm.cli import main

    code = main([
        "train", str(TINY), f"data.manifest={manifest}", f"out_dir={out_dir}", "optim.max_steps=3",
        "optim.epochs=1", *overrides,
    ])
    assert code == 0
    lines = (out_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("name", sorted(END_TO_END))
def test_trains_end_to_end_on_the_tiny_corpus(name: str, tiny_corpus: Path, tmp_path: Path) -> None:
    records = train_tiny(tiny_corpus, tmp_path / "run", END_TO_END[name])
    steps = [r for r in records if r["kind"] == "step"]
    assert steps and EXPECTED_TERMS[name] <= set(steps[0])
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert (tmp_path / "run" / "last" / "model.safetensors").is_file()
    if "svr" in name:
        epochs = [r for r in records if r["kind"] == "epoch"]
        assert epochs and math.isfinite(epochs[-1]["svr_mean_radius"])
