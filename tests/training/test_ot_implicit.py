"""Implicit Sinkhorn gradient (training/ot.py, ``gradient="implicit"``) against autograd through the solver.

The implicit backward differentiates the converged fixed point; autograd through the same
log-domain iterations, run in float64 until the row marginals are exact to 1e-12, is the
reference. Cases: DART presets' IOT (ε = 0.1 on C / max C), ε = 0.05 on C / max C, the
paper's ε = 0.03 on raw distances (with embeddings for which Sinkhorn converges), and a
batched cost. Also: the loss value is the unrolled one bit for bit, and the tensors kept for
backward stay a few B × B matrices instead of two per iteration.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training.objectives.iot import IOT, IOTConfig, iot_loss
from training.ot import normalize_cost, pairwise_euclidean, sinkhorn_log_plan


def _embeddings(batch: int, noise: float, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch)
    audio = F.normalize(torch.randn(batch, 16, generator=gen, dtype=dtype), dim=-1)
    text = F.normalize(audio + noise * torch.randn(batch, 16, generator=gen, dtype=dtype), dim=-1)
    return audio, text


def _gradients(left: torch.Tensor, right: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    left, right = left.clone().requires_grad_(True), right.clone().requires_grad_(True)
    loss, _ = iot_loss(left, right, **kwargs)  # type: ignore[arg-type]
    loss.backward()
    assert left.grad is not None and right.grad is not None
    return loss.detach(), torch.cat([left.grad, right.grad])


@pytest.mark.parametrize(
    ("batch", "eps", "normalization", "noise", "fifty_converge"),
    [
        (8, 0.1, "max", 0.3, True),     # DART presets (configs/dart/*.yaml)
        (64, 0.1, "max", 0.3, True),
        (32, 0.05, "max", 0.3, True),
        (48, 0.03, "max", 1.0, False),  # m-LTM's ε on C / max C
        (16, 0.03, "none", 1.0, False),  # IOTConfig defaults (DART Eq. 4 as printed); ~250 iterations
    ],
)
def test_implicit_gradient_matches_autograd_through_the_converged_solver(
    batch: int, eps: float, normalization: str, noise: float, fifty_converge: bool
) -> None:
    left, right = _embeddings(batch, noise)
    converged = {"eps": eps, "iters": 3000, "tol": 1e-12, "cost_normalization": normalization}
    ref_loss, reference = _gradients(left, right, gradient="unrolled", **converged)
    loss, implicit = _gradients(left, right, gradient="implicit", **converged)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert (implicit - reference).abs().max() <= 1e-4 * reference.abs().max()
    if not fifty_converge:
        return
    # Where 50 iterations converge, the preset's 50 / tol 1e-4 in float32 give the same gradient.
    _, preset = _gradients(left.float(), right.float(), gradient="implicit", eps=eps, iters=50, tol=1e-4,
                           cost_normalization=normalization)
    assert (preset.double() - reference).abs().max() <= 1e-3 * reference.abs().max()


def test_implicit_gradient_of_a_batched_plan_with_a_dense_upstream_gradient() -> None:
    gen = torch.Generator().manual_seed(5)
    cost = torch.rand(3, 12, 9, generator=gen, dtype=torch.float64)
    weights = torch.randn(3, 12, 9, generator=gen, dtype=torch.float64)
    grads = []
    for gradient in ("unrolled", "implicit"):
        leaf = cost.clone().requires_grad_(True)
        (sinkhorn_log_plan(leaf, eps=0.2, iters=3000, tol=1e-12, gradient=gradient) * weights).sum().backward()
        grads.append(leaf.grad)
    assert grads[0] is not None and grads[1] is not None
    assert (grads[1] - grads[0]).abs().max() <= 1e-6 * grads[0].abs().max()


@pytest.mark.parametrize("normalization", ["none", "max"])
def test_loss_value_is_the_unrolled_one_bit_for_bit(normalization: str) -> None:
    left, right = _embeddings(32, 0.3, torch.float32)
    kwargs = {"eps": 0.1, "iters": 50, "tol": 1e-4, "cost_normalization": normalization}
    unrolled = iot_loss(left, right, gradient="unrolled", **kwargs)  # type: ignore[arg-type]
    implicit = iot_loss(left, right, gradient="implicit", **kwargs)  # type: ignore[arg-type]
    assert torch.equal(unrolled[0], implicit[0]) and torch.equal(unrolled[1], implicit[1])


def _saved_bytes(fn: object) -> int:
    """Bytes of the tensors autograd keeps for backward, each storage counted once."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()  # type: ignore[operator]
    return sum(storages.values())


def test_implicit_keeps_a_few_batch_squared_matrices() -> None:
    batch = 128
    left, right = _embeddings(batch, 1.0, torch.float32)
    left.requires_grad_(True)
    square = batch * batch * 4

    def run(gradient: str) -> int:
        return _saved_bytes(lambda: iot_loss(left, right, eps=0.1, iters=50, tol=None, cost_normalization="max",
                                             gradient=gradient))  # type: ignore[arg-type]

    assert run("implicit") <= 4 * square
    assert run("unrolled") >= 50 * square  # two per iteration


def test_iot_term_defaults_to_implicit_and_keeps_the_unrolled_option() -> None:
    assert IOTConfig().gradient == "implicit"
    assert IOTConfig(gradient="unrolled").gradient == "unrolled"
    with pytest.raises(ValueError):
        IOTConfig(gradient="checkpointed")  # type: ignore[arg-type]
    left, right = _embeddings(16, 0.3, torch.float32)
    losses = []
    for gradient in ("implicit", "unrolled"):
        term = IOT(IOTConfig(gradient=gradient, eps=0.1, cost_normalization="max"), None)  # type: ignore[arg-type]
        from training.objectives.base import AlignedPair

        pair = AlignedPair(left=left, right=right, clip_index=torch.arange(16), kind="audio-text", weight=1.0,
                           name="test")
        losses.append(term(pair)["iot_loss"])
    assert torch.equal(losses[0], losses[1]) and math.isfinite(float(losses[0]))


def test_implicit_refuses_marginals_that_need_a_gradient() -> None:
    cost = torch.rand(4, 4)
    a = torch.full((4,), 0.25, requires_grad=True)
    with pytest.raises(ValueError, match="marginals"):
        sinkhorn_log_plan(cost, a, eps=0.1, gradient="implicit")
    with pytest.raises(ValueError, match="gradient"):
        sinkhorn_log_plan(normalize_cost(pairwise_euclidean(cost, cost), "max"), eps=0.1, gradient="both")  # type: ignore[arg-type]


def test_iot_gradient_is_target_minus_plan_over_eps() -> None:
    # L = −1/B Σ_i log(B Π_ii) = (⟨I/B, C⟩ − OT_ε(C)) / ε + const at the fixed point (dual
    # optimality), so ∂L/∂C = (I/B − Π)/ε: the adjoint solve must reproduce it (x = −1, y = 0).
    gen = torch.Generator().manual_seed(0)
    cost = torch.rand(24, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    log_plan = sinkhorn_log_plan(cost, eps=0.1, iters=3000, tol=1e-12, gradient="implicit")
    (-(log_plan.diagonal() + math.log(24)).mean()).backward()
    closed = (torch.eye(24, dtype=torch.float64) / 24 - log_plan.detach().exp()) / 0.1
    assert cost.grad is not None
    torch.testing.assert_close(cost.grad, closed, atol=1e-7, rtol=0)  # |grad| ≤ 0.4
