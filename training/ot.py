"""Entropic optimal transport solvers (log domain, batched, torch), shared by DART and ASK.

Pure functions in the style of POT (``ot.sinkhorn(..., method="sinkhorn_log")`` and
``ot.unbalanced.sinkhorn_unbalanced(..., reg_type="kl")``): objectives build a cost
matrix and call them. Everything runs on log-scalings ``log u``, ``log v`` and the
log-kernel ``log K = −C/ε + log c``, so costs of a few units with ε = 0.01 neither
underflow nor overflow in float32.

Gradients of the balanced plan (DART's IOT loss differentiates it) come in two kinds
(``gradient=``): ``unrolled`` backpropagates through every Sinkhorn iteration (autograd
keeps two n × m matrices per iteration), ``implicit`` runs the iterations without a graph
and differentiates the converged fixed point through its optimality conditions
(:class:`_ImplicitSinkhornLog`; one n × m matrix kept). Callers that want a constant plan
(DART's UWD, ASK's realignment) pass a detached cost or call under ``torch.no_grad()``.

Shapes: ``cost`` (..., n, m) with any leading batch dims; ``a`` (..., n) / (n,) and
``b`` (..., m) / (m,), broadcast against the batch dims; None means uniform
(``1/n``, ``1/m``).

References: Cuturi 2013 (Sinkhorn distances); Chizat, Peyré, Schmitzer & Vialard
2018 (scaling algorithms for unbalanced transport, Alg. 2); Peyré & Cuturi,
*Computational Optimal Transport* §4.4 (log-domain stabilisation); POT
``ot.bregman.sinkhorn_log`` and ``ot.unbalanced.sinkhorn_knopp_unbalanced``; Luise, Rudi,
Pontil & Ciliberto 2018 (differential properties of Sinkhorn, Thm. 2) and Eisenberger,
Toker, Leal-Taixé, Bernard & Cremers 2022 (a unified framework for implicit Sinkhorn
differentiation, Eq. 9–12) for the implicit gradient.

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
Gradient = Literal["implicit", "unrolled"]


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


def _adjoint_potentials(
    plan: Tensor, p: Tensor, q: Tensor, *, max_iters: int, rtol: float
) -> tuple[Tensor, Tensor]:
    """Solve ``[[diag(r), Π], [Πᵀ, diag(c)]] [x; y] = [p; q]`` with ``r = Π1``, ``c = Πᵀ1``.

    The matrix is the Jacobian of the balanced marginal conditions w.r.t. the log-scalings
    (Eisenberger et al. 2022, Eq. 10); it is symmetric positive semi-definite with the
    one-dimensional null space ``(1, −1)`` (shifting ``log u`` up and ``log v`` down leaves Π
    unchanged), and ``Σp = Σq`` makes the system consistent. Eliminating ``x = (p − Π y) / r``
    leaves the Schur complement ``S y = q − Πᵀ(p / r)``, ``S = diag(c) − Πᵀ diag(1/r) Π``
    (c × c, null space 1), solved by conjugate gradients preconditioned with ``diag(c)``: the
    preconditioned operator is ``I − K̃ᵀK̃`` with ``K̃ = diag(r)^{-½} Π diag(c)^{-½}``, whose
    spectral gap is the one that sets Sinkhorn's own linear rate, so a plan Sinkhorn converged
    on needs a few dozen CG steps, each two matrix–vector products with Π (no n × m
    temporaries). The residual is projected onto ``1^⊥`` (the range of S) every step so
    rounding cannot feed the null space. Batched over leading dims.
    """
    rows, cols = plan.sum(-1), plan.sum(-2)

    def schur(vec: Tensor) -> Tensor:
        plan_vec = (plan @ vec.unsqueeze(-1)).squeeze(-1)
        return cols * vec - ((plan_vec / rows).unsqueeze(-2) @ plan).squeeze(-2)

    def project(vec: Tensor) -> Tensor:
        return vec - vec.mean(-1, keepdim=True)

    rhs = project(q - (((p / rows).unsqueeze(-2)) @ plan).squeeze(-2))
    y = torch.zeros_like(rhs)
    residual = rhs
    target = rtol * rhs.norm(dim=-1, keepdim=True)
    z = residual / cols
    direction = z
    rz = (residual * z).sum(-1, keepdim=True)
    for _ in range(max_iters):
        if bool((residual.norm(dim=-1, keepdim=True) <= target).all()):
            break
        s_dir = schur(direction)
        curvature = (direction * s_dir).sum(-1, keepdim=True)
        # A converged batch element (or a zero right-hand side) has rz = 0: take no step.
        alpha = torch.where(curvature > 0, rz / curvature.clamp(min=torch.finfo(rz.dtype).tiny), 0.0)
        y = y + alpha * direction
        residual = project(residual - alpha * s_dir)
        z = residual / cols
        rz_next = (residual * z).sum(-1, keepdim=True)
        beta = torch.where(rz > 0, rz_next / rz.clamp(min=torch.finfo(rz.dtype).tiny), 0.0)
        direction = z + beta * direction
        rz = rz_next
    x = (p - (plan @ y.unsqueeze(-1)).squeeze(-1)) / rows
    return x, y


class _ImplicitSinkhornLog(torch.autograd.Function):
    """log Π* of balanced entropic OT, differentiated at the converged fixed point.

    Forward: the same log-domain iterations as the unrolled solver, without a graph, so the
    value is the unrolled one bit for bit. Backward (Luise et al. 2018, Thm. 2; Eisenberger et
    al. 2022, Eq. 9–12): with ``log Π = α ⊕ β + θ``, ``θ = −C/ε``, the marginal conditions
    ``Σ_j Π_ij = a_i``, ``Σ_i Π_ij = b_j`` differentiate to ``H [dα; dβ] = −[(Π⊙dθ)1; (Π⊙dθ)ᵀ1]``
    with ``H = [[diag(Π1), Π], [Πᵀ, diag(Πᵀ1)]]``. For an upstream gradient G = ∂L/∂log Π,
    solving the adjoint ``H [x; y] = [G1; Gᵀ1]`` gives
    ``∂L/∂θ = G − Π ⊙ (x ⊕ y)`` and ``∂L/∂C = (Π ⊙ (x ⊕ y) − G) / ε``; the null space
    ``(x + t, y − t)`` of H leaves ``x ⊕ y`` unchanged. The loss is not the OT cost, so the
    envelope theorem (∂OT/∂C = Π) does not apply; this is its exact replacement at the fixed
    point. Saved for backward: C and the two potentials (C is usually already saved by the
    cost's own graph, and storage is shared). Marginals get no gradient.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, cost: Tensor, log_a: Tensor, log_b: Tensor, eps: float,
        iters: int, tol: float | None, cg_iters: int, cg_rtol: float,
    ) -> Tensor:
        log_k = -cost / eps
        log_u, log_v = _scaling_iterations(log_k, log_a, log_b, exponent=1.0, iters=iters, tol=tol, balanced=True)
        ctx.save_for_backward(cost, log_u, log_v)
        ctx.eps, ctx.cg_iters, ctx.cg_rtol = eps, cg_iters, cg_rtol  # type: ignore[attr-defined]
        return log_u.unsqueeze(-1) + log_k + log_v.unsqueeze(-2)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_log_plan: Tensor
    ) -> tuple[Tensor | None, ...]:
        cost, log_u, log_v = ctx.saved_tensors  # type: ignore[attr-defined]
        eps: float = ctx.eps  # type: ignore[attr-defined]
        # In place: one n × m matrix for Π, one for the result.
        plan = cost.div(-eps).add_(log_u.unsqueeze(-1)).add_(log_v.unsqueeze(-2)).exp_()
        x, y = _adjoint_potentials(plan, grad_log_plan.sum(-1), grad_log_plan.sum(-2),
                                   max_iters=ctx.cg_iters, rtol=ctx.cg_rtol)  # type: ignore[attr-defined]
        grad_cost = plan * x.unsqueeze(-1)
        grad_cost.addcmul_(plan, y.unsqueeze(-2)).sub_(grad_log_plan).div_(eps)
        return grad_cost, None, None, None, None, None, None, None


def sinkhorn_log_plan(
    cost: Tensor, a: Tensor | None = None, b: Tensor | None = None, *, eps: float, iters: int = 100,
    tol: float | None = None, gradient: Gradient = "unrolled", cg_iters: int = 200, cg_rtol: float | None = None,
) -> Tensor:
    """log Π* of balanced entropic OT (see :func:`sinkhorn_log`), without leaving the log domain.

    ``gradient``: ``unrolled`` (autograd through every iteration; memory ≈ 2 × iterations
    n × m matrices) or ``implicit`` (:class:`_ImplicitSinkhornLog`: the same forward without a
    graph, the gradient of the converged fixed point by ``cg_iters`` conjugate-gradient steps
    to a relative residual ``cg_rtol``, default 1e-6 in float32 and 1e-12 in float64; one
    n × m matrix kept). Both give the same value; their gradients agree once Sinkhorn has
    converged (tests/training/test_ot_implicit.py). ``implicit`` gives marginals no gradient.
    """
    if eps <= 0:
        raise ValueError(f"eps must be positive, got {eps}")
    cost = _at_least_float32(cost)
    n, m = cost.shape[-2:]
    log_a = _log_marginal(a, n, cost)
    log_b = _log_marginal(b, m, cost)
    if gradient == "implicit":
        if (a is not None and a.requires_grad) or (b is not None and b.requires_grad):
            raise ValueError("gradient='implicit' does not differentiate the marginals; use 'unrolled'")
        rtol = cg_rtol if cg_rtol is not None else (1e-12 if cost.dtype == torch.float64 else 1e-6)
        out: Tensor = _ImplicitSinkhornLog.apply(cost, log_a, log_b, eps, iters, tol, cg_iters, rtol)
        return out
    if gradient != "unrolled":
        raise ValueError(f"gradient must be 'implicit' or 'unrolled', got {gradient!r}")
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
