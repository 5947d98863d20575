"""DART (SPEC §4.5): IOT loss, UWD regularizer, reliability-aware marginals, configs, end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ROOT, TINY_CONFIG
from tonearm.cli import main
from training.config import load_train_config
from training.objectives.base import AlignedPair, BuildEnv, EmbeddingBatch, total_loss
from training.objectives.iot import IOT, IOTConfig, iot_loss
from training.objectives.registry import build_objective
from training.objectives.uwd import (
    UWD,
    ReliabilityEMA,
    UWDConfig,
    batch_reliability,
    channel_statistics,
)
from training.ot import pairwise_euclidean, sinkhorn_log, sinkhorn_unbalanced_log

ENV = BuildEnv(languages=("eng", "fra"), embed_dim=16)


def _pair(left: torch.Tensor, right: torch.Tensor) -> AlignedPair:
    return AlignedPair(left=left, right=right, clip_index=torch.arange(left.shape[0]), kind="audio-text", weight=1.0,
                       name="test")


def _embeddings(seed: int, batch: int = 8, dim: int = 16, noise: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    audio = F.normalize(torch.randn(batch, dim, generator=gen), dim=-1)
    text = F.normalize(audio + noise * torch.randn(batch, dim, generator=gen), dim=-1)
    return audio, text


# --- IOT ------------------------------------------------------------------------------------

def test_iot_value_is_the_diagonal_log_plan() -> None:
    u, v = _embeddings(0, batch=6)
    plan = sinkhorn_log(torch.cdist(u.double(), v.double()), eps=0.03, iters=300)
    expected = -torch.log(6 * plan.diagonal()).mean()
    loss, error = iot_loss(u.double(), v.double(), eps=0.03, iters=300, tol=None)
    torch.testing.assert_close(loss, expected, atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(error, (plan.sum(1) - 1 / 6).abs().sum())


@pytest.mark.parametrize("normalization", ["none", "max"])
def test_iot_gradient_matches_finite_differences(normalization: str) -> None:
    gen = torch.Generator().manual_seed(3)
    u = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)

    def loss(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return iot_loss(left, right, eps=0.5, iters=30, tol=None, cost_normalization=normalization)[0]  # type: ignore[arg-type]

    assert torch.autograd.gradcheck(loss, (u, v), eps=1e-6, atol=1e-6)


def test_iot_prefers_aligned_pairs() -> None:
    u, v = _embeddings(1)
    term = IOT(IOTConfig(), ENV)
    aligned = term(_pair(u, v))["iot_loss"]
    shuffled = term(_pair(u, v.roll(1, dims=0)))["iot_loss"]
    assert aligned < shuffled


# --- RAM --------------------------------------------------------------------------------------

def test_channel_statistics_by_hand() -> None:
    u = torch.tensor([[1.0], [2.0], [3.0], [6.0]])  # mean 3, deviations -2 -1 0 3
    v = torch.tensor([[2.0], [2.0], [4.0], [4.0]])  # mean 3, deviations -1 -1 1 1
    stats = channel_statistics(u, v, eps=0.0)
    var_u, var_v = (4 + 1 + 0 + 9) / 4, 1.0
    kurt_u = ((16 + 1 + 0 + 81) / 4) / var_u**2
    corr = ((2 + 1 + 0 + 3) / 4) / math.sqrt(var_u * var_v)
    torch.testing.assert_close(stats["var"], torch.tensor([var_u + var_v]))
    torch.testing.assert_close(stats["kurt"], torch.tensor([kurt_u + 1.0]))
    torch.testing.assert_close(stats["corr"], torch.tensor([corr]))
    expected = torch.sigmoid(torch.tensor([corr - (var_u + var_v) - (kurt_u + 1.0)]))
    torch.testing.assert_close(batch_reliability(u, v, "ram"), expected)


def test_noise_channel_is_less_reliable_than_a_correlated_one() -> None:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randn(256, generator=gen)
    u = torch.stack([shared, torch.randn(256, generator=gen)], dim=1)
    v = torch.stack([shared, torch.randn(256, generator=gen)], dim=1)  # channel 0: identical; 1: independent noise
    for kind in ("ram", "corr"):
        r = batch_reliability(u, v, kind)
        assert r[0] > r[1], kind
    assert torch.equal(batch_reliability(u, v, "uniform"), torch.ones(2))


def test_reliability_ema_update() -> None:
    ema = ReliabilityEMA(3, beta=0.9)
    first, second, third = torch.tensor([0.2, 0.4, 0.6]), torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.0, 1.0, 0.5])
    torch.testing.assert_close(ema.blend(first), first)  # nothing committed yet
    ema.observe(first)
    ema.commit()
    torch.testing.assert_close(ema.value, first)  # initialised with the first step
    ema.observe(second)
    ema.observe(third)  # two pairs in one step: their mean is the step's statistic
    ema.commit()
    expected = 0.9 * first + 0.1 * (second + third) / 2
    torch.testing.assert_close(ema.value, expected)
    torch.testing.assert_close(ema.blend(second), 0.9 * expected + 0.1 * second)
    ema.commit()  # a step without pairs leaves the state alone
    torch.testing.assert_close(ema.value, expected)


# --- UWD --------------------------------------------------------------------------------------

def test_uwd_is_weighted_cost_under_a_detached_plan() -> None:
    u, v = _embeddings(2)
    u.requires_grad_(True)
    term = UWD(UWDConfig(marginals="uniform"), ENV)
    out = term(_pair(u, v))
    cost = pairwise_euclidean(u.t(), v.t())
    plan = sinkhorn_unbalanced_log(cost.detach(), eps=0.03, reg_m=0.05, iters=50, tol=1e-4)
    torch.testing.assert_close(out["uwd_loss"], 0.5 * (cost * plan).sum())
    (grad,) = torch.autograd.grad(out["uwd_loss"], u)
    (expected,) = torch.autograd.grad(0.5 * (cost * plan).sum(), u)
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(out["ram_entropy"], torch.tensor(1.0))


def test_uwd_with_ram_uses_the_ema_marginal() -> None:
    term = UWD(UWDConfig(marginals="ram"), ENV)
    u1, v1 = _embeddings(4)
    term(_pair(u1, v1))
    term.on_step_start(None)  # type: ignore[arg-type]
    r1 = batch_reliability(u1, v1, "ram")
    torch.testing.assert_close(term.reliability.value, r1)
    u2, v2 = _embeddings(5)
    marginal = term.marginal(u2, v2)
    expected = 0.9 * r1 + 0.1 * batch_reliability(u2, v2, "ram")
    torch.testing.assert_close(marginal, expected / expected.sum())


def test_uwd_is_skipped_for_text_text_pairs() -> None:
    assert "text-text" not in UWD.kinds


# --- properties of the composed objective -----------------------------------------------------

@pytest.mark.parametrize("marginals", ["uniform", "ram", "l2norm", "variance"])
def test_dart_is_invariant_to_jointly_permuting_the_batch(marginals: str) -> None:
    objective = build_objective(_dart_config(marginals), ENV)
    u, v = _embeddings(6, batch=10)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    base = objective(_batch(u, v))
    permuted = objective(_batch(u[perm], v[perm]))
    for key in ("iot_loss", "uwd_loss"):
        torch.testing.assert_close(base[key], permuted[key], atol=1e-5, rtol=1e-5)


def test_a_few_steps_lower_the_dart_loss() -> None:
    objective = build_objective(_dart_config("ram"), ENV)
    u0, v0 = _embeddings(7, noise=1.0)
    audio, text = torch.nn.Parameter(u0.clone()), torch.nn.Parameter(v0.clone())
    optimizer = torch.optim.Adam([audio, text], lr=0.02)

    def loss() -> torch.Tensor:
        return total_loss(objective(_batch(F.normalize(audio, dim=-1), F.normalize(text, dim=-1))))

    first = loss().item()
    for _ in range(15):
        objective.on_step_start(None)  # type: ignore[arg-type]
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    assert loss().item() < first


def _dart_config(marginals: str):  # noqa: ANN202
    from training.config import ObjectiveConfig

    return ObjectiveConfig(base={"name": "iot"}, regularizers=[{"name": "uwd", "marginals": marginals}])


def _batch(u: torch.Tensor, v: torch.Tensor) -> EmbeddingBatch:
    return EmbeddingBatch(audio=u, text=v.unsqueeze(0), text_mask=torch.ones(1, u.shape[0], dtype=torch.bool),
                          clip_index=torch.arange(u.shape[0]))


# --- shipped configs and end to end ----------------------------------------------------------

@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "dart").glob("dart_*.yaml")), ids=lambda p: p.stem)
def test_shipped_dart_configs_build(path: Path) -> None:
    cfg = load_train_config(path)
    objective = build_objective(cfg.objective, BuildEnv(languages=tuple(cfg.data.languages), embed_dim=cfg.model.embed_dim))
    assert isinstance(objective.base, IOT)
    assert [type(r) for r in objective.regularizers] == [UWD]


def test_dart_trains_end_to_end(tiny_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = main([
        "train", str(TINY_CONFIG), f"data.manifest={tiny_corpus}", f"out_dir={out}", "optim.epochs=1",
        "optim.batch_size=4", "data.max_clips=12", "objective.base={name: iot}",
        "objective.regularizers=[{name: uwd, marginals: ram}]",
    ])
    assert code == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in steps if r["kind"] == "step")
    assert math.isfinite(step["iot_loss"]) and step["uwd_loss"] > 0 and 0 < step["ram_entropy"] <= 1
