"""Entropic optimal transport solvers (log domain, batched, torch), shared by DART and ASK.

Pure functions in the style of POT (``ot.sinkhorn(..., method="sinkhorn_log")`` and
``ot.unbalanced.sinkhorn_unbalanced(..., reg_type="kl")``): objectives build a cost
matrix and call them. Everything runs on log-scalings ``log u``, ``log v`` and the
log-kernel ``log K = −C/ε + log c``, so costs of a few units with ε = 0.01 neither
underflow nor overflow in float32.

Gradients flow through the unrolled iterations (DART's IOT loss differentiates the
plan); callers that want a constant plan (DART's UWD, ASK's realignment) pass a
detached cost or call under ``torch.no_grad()``.

Shapes: ``cost`` (..., n, m) with any leading batch dims; ``a`` (..., n) / (n,) and
``b`` (..., m) / (m,), broadcast against the batch dims; None means uniform
(``1/n``, ``1/m``).

References: Cuturi 2013 (Sinkhorn distances); Chizat, Peyré, Schmitzer & Vialard
2018 (scaling algorithms for unbalanced transport, Alg. 2); Peyré & Cuturi,
*Computational Optimal Transport* §4.4 (log-domain stabilisation); POT
``ot.bregman.sinkhorn_log`` and ``ot.unbalanced.sinkhorn_knopp_unbalanced``.

Relations: :mod:`training.objectives.iot` (balanced, differentiable),
:mod:`training.objectives.uwd` (unbalanced, detached),
:mod:`training.objectives.ask` (balanced on −similarity, detached).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

RegType = Literal["kl", "entropy"]
CostNormalization = Literal["none", "max"]


def normalize_cost(cost: Tensor, mode: CostNormalization, *, detach: bool = False) -> Tensor:
    """The cost on the scale ε is chosen for: ``none`` = as is; ``max`` = ``C / max C`` over the batch.

    ``max`` is the convention of m-LTM's OT loss (Luong et al. 2024, ``tools/loss.py``:
    ``M = M / M.max()`` before ``ot.sinkhorn(reg=0.03)``, the maximum not detached), which DART's
    IOT builds on: ε then means the same thing whatever the spread of the embeddings, so a batch
    whose distances shrink as training goes does not turn a fixed ε into an ever softer plan.
    ``detach`` stops the gradient through the maximum (a constant rescaling per step).
    Shapes: (..., n, m) → same; the maximum is per matrix (over the last two dims).
    """
    if mode == "none":
        return cost
    if mode != "max":
        raise ValueError(f"cost normalization must be 'none' or 'max', got {mode!r}")
    peak = cost.amax(dim=(-2, -1), keepdim=True).clamp(min=torch.finfo(cost.dtype).tiny)
    return cost / (peak.detach() if detach else peak)


def pairwise_euclidean(x: Tensor, y: Tensor, *, min_sq: float = 1e-12) -> Tensor:
    """``C_ij = ‖x_i − y_j‖₂`` for x (..., n, d), y (..., m, d) → (..., n, m).

    The squared distance is clamped at ``min_sq`` before the square root so the
    gradient stays finite for coincident points.
    """
    sq = (x * x).sum(-1, keepdim=True) + (y * y).sum(-1).unsqueeze(-2) - 2 * x @ y.transpose(-1, -2)
    return sq.clamp(min=min_sq).sqrt()


def _at_least_float32(cost: Tensor) -> Tensor:
    """Half-precision costs (autocast) are solved in float32: log-sum-exp needs the range."""
    return cost.float() if cost.dtype in (torch.float16, torch.bfloat16) else cost


def _log_marginal(weights: Tensor | None, size: int, like: Tensor) -> Tensor:
    """log of a marginal (..., size); uniform when ``weights`` is None."""
    if weights is None:
        return torch.full((size,), -float(torch.log(torch.tensor(float(size)))), dtype=like.dtype, device=like.device)
    weights = weights.to(dtype=like.dtype, device=like.device)
    if weights.shape[-1] != size:
        raise ValueError(f"marginal has {weights.shape[-1]} entries, the cost matrix {size}")
    return weights.clamp(min=torch.finfo(like.dtype).tiny).log()


def _scaling_iterations(
    log_k: Tensor, log_a: Tensor, log_b: Tensor, *, exponent: float, iters: int, tol: float | None,
    balanced: bool, check_every: int = 10,
) -> tuple[Tensor, Tensor]:
    """Generalised Sinkhorn in log space: ``log u = κ (log a − LSE_j(log K_ij + log v_j))``, same for v.

    ``κ = exponent`` is 1 for balanced OT and ``ρ/(ρ+ε)`` for KL-relaxed marginals.
    Stops early when the row-marginal error (balanced) or the sup change of the
    log-scalings (unbalanced) falls below ``tol``, checked every ``check_every`` steps.
    """
    batch_shape = log_k.shape[:-2]
    log_u = torch.zeros((*batch_shape, log_k.shape[-2]), dtype=log_k.dtype, device=log_k.device)
    log_v = torch.zeros((*batch_shape, log_k.shape[-1]), dtype=log_k.dtype, device=log_k.device)
    for step in range(iters):
        previous = log_u
        log_u = exponent * (log_a - torch.logsumexp(log_k + log_v.unsqueeze(-2), dim=-1))
        log_v = exponent * (log_b - torch.logsumexp(log_k + log_u.unsqueeze(-1), dim=-2))
        if tol is not None and (step + 1) % check_every == 0:
            with torch.no_grad():
                if balanced:
                    rows = torch.logsumexp(log_k + log_u.unsqueeze(-1) + log_v.unsqueeze(-2), dim=-1)
                    error = (rows.exp() - log_a.exp()).abs().sum(-1).max()
                else:
                    error = (log_u - previous).abs().max()
            if float(error) < tol:
                break
    return log_u, log_v


def sinkhorn_log_plan(
    cost: Tensor, a: Tensor | None = None, b: Tensor | None = None, *, eps: float, iters: int = 100,
    tol: float | None = None,
) -> Tensor:
    """log Π* of balanced entropic OT (see :func:`sinkhorn_log`), without leaving the log domain."""
    if eps <= 0:
        raise ValueError(f"eps must be positive, got {eps}")
    cost = _at_least_float32(cost)
    n, m = cost.shape[-2:]
    log_a = _log_marginal(a, n, cost)
    log_b = _log_marginal(b, m, cost)
    log_k = -cost / eps
    log_u, log_v = _scaling_iterations(log_k, log_a, log_b, exponent=1.0, iters=iters, tol=tol, balanced=True)
    return log_u.unsqueeze(-1) + log_k + log_v.unsqueeze(-2)


def sinkhorn_log(
    cost: Tensor, a: Tensor | None = None, b: Tensor | None = None, *, eps: float, iters: int = 100,
    tol: float | None = None,
) -> Tensor:
    """Balanced entropic OT plan by log-domain Sinkhorn.

    Solves ``Π* = argmin_{Π ≥ 0, Π1 = a, Πᵀ1 = b} ⟨C, Π⟩ − ε H(Π)`` with
    ``H(Π) = −Σ_ij Π_ij (log Π_ij − 1)`` (DART Eq. 1; Cuturi 2013). The solution is
    ``Π_ij = u_i K_ij v_j`` with ``K = exp(−C/ε)``; ``iters`` alternating updates of
    ``log u`` and ``log v`` are unrolled (differentiable w.r.t. ``cost``). After the
    last update the column marginals are exact and the row marginals approximate.

    Args:
        cost: C (..., n, m).
        a, b: marginals (..., n), (..., m) summing to the same mass; None = uniform.
        eps: entropic regularisation ε > 0.
        iters: maximum number of (u, v) update pairs.
        tol: stop once ``Σ_i |Π1 − a|_i`` is below it (checked every 10 iterations).

    Returns: the plan Π (..., n, m).
    """
    return sinkhorn_log_plan(cost, a, b, eps=eps, iters=iters, tol=tol).exp()


def sinkhorn_unbalanced_log(
    cost: Tensor, a: Tensor | None = None, b: Tensor | None = None, *, eps: float, reg_m: float,
    iters: int = 100, tol: float | None = None, reg_type: RegType = "kl",
) -> Tensor:
    """Unbalanced entropic OT plan (KL-relaxed marginals) by log-domain scaling.

    Solves ``P* = argmin_{P ≥ 0} ⟨C, P⟩ + ε KL(P ‖ c) + ρ KL(P1 ‖ a) + ρ KL(Pᵀ1 ‖ b)``
    with the generalised ``KL(x ‖ y) = Σ x log(x/y) − x + y``, ``ρ = reg_m`` and the
    reference ``c = a bᵀ`` (``reg_type="kl"``, POT's default since 0.9.5) or
    ``c = 1 1ᵀ`` (``reg_type="entropy"``, i.e. ``−ε H(P)``). DART Eq. 8/12 with the
    entropic term SPEC §4.5 adds. The scaling updates are ``u = (a / K v)^{ρ/(ρ+ε)}``,
    ``v = (b / Kᵀ u)^{ρ/(ρ+ε)}`` with ``K = c ⊙ exp(−C/ε)`` (Chizat et al. 2018).

    Args:
        cost: C (..., n, m).
        a, b: positive target marginals (..., n), (..., m); None = uniform.
        eps: entropic regularisation ε > 0.
        reg_m: marginal relaxation ρ > 0 (ρ → ∞ recovers balanced OT).
        iters: maximum number of update pairs.
        tol: stop once the sup change of ``log u`` is below it (checked every 10 iterations).
        reg_type: reference measure of the entropic term, as in POT.

    Returns: the plan P (..., n, m).
    """
    if eps <= 0 or reg_m <= 0:
        raise ValueError(f"eps and reg_m must be positive, got eps={eps}, reg_m={reg_m}")
    cost = _at_least_float32(cost)
    n, m = cost.shape[-2:]
    log_a = _log_marginal(a, n, cost)
    log_b = _log_marginal(b, m, cost)
    log_k = -cost / eps
    if reg_type == "kl":
        log_k = log_k + log_a.unsqueeze(-1) + log_b.unsqueeze(-2)
    elif reg_type != "entropy":
        raise ValueError(f"reg_type must be 'kl' or 'entropy', got {reg_type!r}")
    exponent = reg_m / (reg_m + eps)
    log_u, log_v = _scaling_iterations(log_k, log_a, log_b, exponent=exponent, iters=iters, tol=tol, balanced=False)
    return (log_u.unsqueeze(-1) + log_k + log_v.unsqueeze(-2)).exp()
