"""Log-domain Sinkhorn solvers (training/ot.py) against plain-domain references and POT."""

from __future__ import annotations

import warnings

import numpy as np
import ot
import pytest
import torch

from training.ot import (
    normalize_cost,
    pairwise_euclidean,
    sinkhorn_log,
    sinkhorn_log_plan,
    sinkhorn_unbalanced_log,
)


def _problem(seed: int, n: int, m: int, *, scale: float = 2.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    cost = rng.uniform(0, scale, size=(n, m))
    a = rng.uniform(0.2, 1.0, size=n)
    b = rng.uniform(0.2, 1.0, size=m)
    return cost, a / a.sum(), b / b.sum()


def _plain_scaling(cost, a, b, *, eps, exponent=1.0, reference=None, iters=5000):  # noqa: ANN001, ANN202
    """Textbook Sinkhorn / Chizat scaling in the plain domain (float64)."""
    kernel = np.exp(-cost / eps) * (np.outer(a, b) if reference is None else reference)
    u, v = np.ones_like(a), np.ones_like(b)
    for _ in range(iters):
        u = (a / (kernel @ v)) ** exponent
        v = (b / (kernel.T @ u)) ** exponent
    return u[:, None] * kernel * v[None, :]


def _kl(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sum(x * np.log(x / y) - x + y))


def _unbalanced_objective(plan, cost, a, b, *, eps, reg_m, reference) -> float:  # noqa: ANN001
    return float(
        (cost * plan).sum() + eps * _kl(plan, reference) + reg_m * _kl(plan.sum(1), a) + reg_m * _kl(plan.sum(0), b)
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_matches_plain_reference(seed: int) -> None:
    cost, a, b = _problem(seed, 5, 7)
    reference = _plain_scaling(cost, a, b, eps=0.3)
    plan = sinkhorn_log(torch.from_numpy(cost), torch.from_numpy(a), torch.from_numpy(b), eps=0.3, iters=2000).numpy()
    assert np.abs(plan.sum(1) - a).max() < 1e-5
    assert np.abs(plan.sum(0) - b).max() < 1e-5
    np.testing.assert_allclose(plan, reference, atol=1e-8)


@pytest.mark.parametrize("reg_type", ["kl", "entropy"])
@pytest.mark.parametrize("seed", [0, 3])
def test_unbalanced_objective_matches_plain_reference(seed: int, reg_type: str) -> None:
    cost, a, b = _problem(seed, 6, 4)
    eps, reg_m = 0.2, 0.5
    ref_measure = np.outer(a, b) if reg_type == "kl" else np.ones_like(cost)
    reference = _plain_scaling(cost, a, b, eps=eps, exponent=reg_m / (reg_m + eps), reference=ref_measure)
    plan = sinkhorn_unbalanced_log(
        torch.from_numpy(cost), torch.from_numpy(a), torch.from_numpy(b), eps=eps, reg_m=reg_m, iters=2000,
        reg_type=reg_type,  # type: ignore[arg-type]
    ).numpy()
    kwargs = {"eps": eps, "reg_m": reg_m, "reference": ref_measure}
    assert abs(_unbalanced_objective(plan, cost, a, b, **kwargs) - _unbalanced_objective(reference, cost, a, b, **kwargs)) < 1e-4
    # The mass really is relaxed: it differs from the balanced total of 1.
    assert abs(plan.sum() - 1.0) > 1e-3


@pytest.mark.parametrize("seed", range(5))
def test_balanced_matches_pot(seed: int) -> None:
    cost, a, b = _problem(seed, 8, 6, scale=4.0)
    expected = ot.sinkhorn(a, b, cost, 0.1, method="sinkhorn_log", numItermax=20_000, stopThr=1e-13)
    plan = sinkhorn_log(torch.from_numpy(cost), torch.from_numpy(a), torch.from_numpy(b), eps=0.1, iters=2000)
    np.testing.assert_allclose(plan.numpy(), expected, atol=1e-4)
    uniform = ot.sinkhorn(np.full(8, 1 / 8), np.full(6, 1 / 6), cost, 0.1, method="sinkhorn_log", numItermax=20_000,
                          stopThr=1e-13)
    np.testing.assert_allclose(sinkhorn_log(torch.from_numpy(cost), eps=0.1, iters=2000).numpy(), uniform, atol=1e-4)


@pytest.mark.parametrize("reg_type", ["kl", "entropy"])
@pytest.mark.parametrize("seed", range(4))
def test_unbalanced_matches_pot(seed: int, reg_type: str) -> None:
    cost, a, b = _problem(seed, 7, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = ot.unbalanced.sinkhorn_unbalanced(
            a, b, cost, 0.1, 0.3, method="sinkhorn", reg_type=reg_type, numItermax=20_000, stopThr=1e-13
        )
    plan = sinkhorn_unbalanced_log(
        torch.from_numpy(cost), torch.from_numpy(a), torch.from_numpy(b), eps=0.1, reg_m=0.3, iters=2000,
        reg_type=reg_type,  # type: ignore[arg-type]
    )
    np.testing.assert_allclose(plan.numpy(), expected, atol=1e-4)


def test_small_eps_is_finite_in_float32() -> None:
    gen = torch.Generator().manual_seed(0)
    cost = (torch.rand(3, 32, 32, generator=gen) * 4).requires_grad_(True)
    log_plan = sinkhorn_log_plan(cost, eps=0.01, iters=200)
    plan = log_plan.exp()
    assert torch.isfinite(log_plan).all() and torch.isfinite(plan).all()
    assert (plan.sum(-2) - 1 / 32).abs().max() < 1e-5  # columns exact after the last update
    log_plan.diagonal(dim1=-2, dim2=-1).sum().backward()
    assert torch.isfinite(cost.grad).all()
    relaxed = sinkhorn_unbalanced_log(cost.detach(), eps=0.01, reg_m=0.05, iters=200)
    assert torch.isfinite(relaxed).all() and relaxed.sum() > 0


def test_batched_equals_one_by_one() -> None:
    gen = torch.Generator().manual_seed(1)
    cost = torch.rand(4, 5, 6, generator=gen, dtype=torch.float64)
    a = torch.softmax(torch.randn(4, 5, generator=gen, dtype=torch.float64), -1)
    b = torch.softmax(torch.randn(4, 6, generator=gen, dtype=torch.float64), -1)
    batched = sinkhorn_log(cost, a, b, eps=0.2, iters=300)
    relaxed = sinkhorn_unbalanced_log(cost, a, b, eps=0.2, reg_m=1.0, iters=300)
    for i in range(4):
        torch.testing.assert_close(batched[i], sinkhorn_log(cost[i], a[i], b[i], eps=0.2, iters=300))
        torch.testing.assert_close(relaxed[i], sinkhorn_unbalanced_log(cost[i], a[i], b[i], eps=0.2, reg_m=1.0, iters=300))


def test_tolerance_stops_early_with_the_same_plan() -> None:
    cost, a, b = _problem(4, 6, 6)
    full = sinkhorn_log(torch.from_numpy(cost), eps=0.3, iters=3000)
    early = sinkhorn_log(torch.from_numpy(cost), eps=0.3, iters=3000, tol=1e-10)
    torch.testing.assert_close(early, full, atol=1e-9, rtol=0)


def test_pairwise_euclidean() -> None:
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    y = torch.tensor([[0.0, 0.0], [0.0, 1.0], [3.0, 4.0]])
    expected = torch.tensor([[0.0, 1.0, 5.0], [5.0, 18.0**0.5, 0.0]])
    torch.testing.assert_close(pairwise_euclidean(x, y), expected, atol=1e-5, rtol=0)


# --- cost scale (IOT's cost_normalization, docs/objectives.md "IOT cost scale") -------------------

def test_a_constant_added_to_every_cost_leaves_the_plan_unchanged() -> None:
    cost, a, b = _problem(3, 6, 6)
    cost_t = torch.tensor(cost)
    plan = sinkhorn_log(cost_t, torch.tensor(a), torch.tensor(b), eps=0.05, iters=2000)
    shifted = sinkhorn_log(cost_t + 7.5, torch.tensor(a), torch.tensor(b), eps=0.05, iters=2000)
    torch.testing.assert_close(shifted, plan, atol=1e-9, rtol=1e-6)
    # and a per-row or per-column offset too: balanced OT is blind to one caption (a column of
    # IOT's cost) moving closer to every audio at once — the hubness mechanism of laggards.md
    offsets = torch.arange(6.0, dtype=cost_t.dtype)
    for shift in (offsets[:, None], offsets[None, :]):
        shifted = sinkhorn_log(cost_t + shift, torch.tensor(a), torch.tensor(b), eps=0.05, iters=2000)
        torch.testing.assert_close(shifted, plan, atol=1e-9, rtol=1e-6)


@pytest.mark.parametrize("c", [0.1, 3.0, 40.0])
def test_cost_scaled_by_c_with_eps_scaled_by_c_leaves_the_plan_unchanged(c: float) -> None:
    cost, _, _ = _problem(4, 8, 8)
    cost_t = torch.tensor(cost)
    plan = sinkhorn_log(cost_t, eps=0.03, iters=3000)
    torch.testing.assert_close(sinkhorn_log(c * cost_t, eps=0.03 * c, iters=3000), plan, atol=1e-9, rtol=1e-6)
    # without scaling ε the plan does change (the test can fail)
    assert not torch.allclose(sinkhorn_log(c * cost_t, eps=0.03, iters=3000), plan, atol=1e-4)


@pytest.mark.parametrize("detach", [False, True])
def test_max_normalization_makes_the_plan_scale_free(detach: bool) -> None:
    cost = torch.tensor(_problem(5, 8, 8)[0])
    normalized = normalize_cost(cost, "max", detach=detach)
    assert float(normalized.max()) == pytest.approx(1.0)
    plan = sinkhorn_log(normalized, eps=0.03, iters=3000)
    for c in (0.2, 5.0):
        again = sinkhorn_log(normalize_cost(c * cost, "max", detach=detach), eps=0.03, iters=3000)
        torch.testing.assert_close(again, plan, atol=1e-9, rtol=1e-6)
    assert normalize_cost(cost, "none") is cost
    with pytest.raises(ValueError, match="none"):
        normalize_cost(cost, "mean")  # type: ignore[arg-type]


def test_max_normalization_gradient_flows_through_the_maximum_unless_detached() -> None:
    cost = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    normalize_cost(cost, "max").sum().backward()
    assert cost.grad is not None and float(cost.grad[1, 1]) != pytest.approx(0.25)  # max entry gets −Σ/max² too
    detached = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    normalize_cost(detached, "max", detach=True).sum().backward()
    assert detached.grad is not None
    torch.testing.assert_close(detached.grad, torch.full((2, 2), 0.25))


def test_iot_with_max_normalization_ignores_the_spread_of_the_embeddings() -> None:
    """Shrinking every distance (embeddings closer together) leaves the normalised IOT loss unchanged
    when the shrink is a pure scaling of the cost; the raw-cost loss changes."""
    from training.objectives.iot import iot_loss

    gen = torch.Generator().manual_seed(0)
    left, right = torch.randn(16, 8, generator=gen, dtype=torch.float64), torch.randn(16, 8, generator=gen, dtype=torch.float64)
    kwargs = {"eps": 0.05, "iters": 500, "tol": None}
    loss, _ = iot_loss(left, right, cost_normalization="max", **kwargs)  # type: ignore[arg-type]
    small, _ = iot_loss(0.3 * left, 0.3 * right, cost_normalization="max", **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(small, loss)
    raw, _ = iot_loss(left, right, **kwargs)  # type: ignore[arg-type]
    raw_small, _ = iot_loss(0.3 * left, 0.3 * right, **kwargs)  # type: ignore[arg-type]
    assert abs(float(raw - raw_small)) > 1e-3
