"""Inverse optimal transport (IOT) loss, DART's instance-level term.

``C_ij = ‖u_i − v_j‖₂``; ``Π = argmin_{Π ∈ U(1/B, 1/B)} ⟨C, Π⟩ − ε H(Π)`` by log-domain
Sinkhorn, and the gradient flows through the plan (implicitly at the fixed point, or through
the unrolled iterations);
``L_IOT = KL(Π̃ ‖ Π) = −1/B Σ_i log(B · Π_ii)`` with the ground-truth matching
``Π̃ = I/B``. ``log Π_ii`` is read from the log-domain solver, never from an
underflowed plan.

Args:
    eps: entropic regularisation ε (default 0.03; plays the role of a temperature on
        Euclidean costs in [0, 2]).
    iters: maximum Sinkhorn iterations (default 50).
    tol: early stop once the row-marginal L1 error is below it (default 1e-4).
    cost_normalization: ``none`` (default, the paper's Eq. 4 as printed) or ``max``: ``C / max C``
        per batch before Sinkhorn, the m-LTM convention DART's code base follows (ε then applies
        to costs in [0, 1]); the DART presets use ``max`` (docs/objectives.md, "IOT cost scale").
    detach_normalizer: stop the gradient through ``max C`` (default false, as in m-LTM).
    gradient: ``implicit`` (default): Sinkhorn runs without an autograd graph and the
        converged fixed point is differentiated through its optimality conditions (Luise et
        al. 2018; Eisenberger et al. 2022 — :class:`training.ot._ImplicitSinkhornLog`): about
        3 B × B float32 matrices kept for backward whatever ``iters``. ``unrolled``: autograd
        through every iteration, ~2 B × B per iteration (≈ 104 B × B at 50). The loss value is
        the same bit for bit; the gradients agree once Sinkhorn has converged (the loss is
        not the OT cost, so ∂L/∂C is not Π: the envelope theorem does not apply).

Shapes: pair.left (B, d), pair.right (B, d) → scalar ``iot_loss``; logs
``iot_marginal_error`` (row-marginal L1 error of the final plan) and ``iot_cost_max``.

References: DART (Guo, Tu & Xu), Eq. 1–2 (EOT/IOT), Eq. 4–5 (mini-batch IOT),
Table 6 (ε = 0.03); Shi et al. 2023 (contrastive learning as IOT); Luong et al. 2024 (m-LTM,
cost divided by its batch maximum); SPEC §4.5.

Relations: alternative base loss to :mod:`.infonce` (InfoNCE is IOT with a
one-sided marginal constraint); :mod:`.uwd` adds DART's feature-level term.
"""

from __future__ import annotations

import math

from pydantic import Field
from torch import Tensor

from training.objectives.base import AlignedPair, BuildEnv, PairTerm, TermConfig
from training.ot import (
    CostNormalization,
    Gradient,
    normalize_cost,
    pairwise_euclidean,
    sinkhorn_log_plan,
)


class IOTConfig(TermConfig):
    eps: float = Field(0.03, gt=0)
    iters: int = Field(50, ge=1)
    tol: float | None = Field(1e-4, gt=0)
    cost_normalization: CostNormalization = "none"
    detach_normalizer: bool = False
    gradient: Gradient = "implicit"


def iot_loss(
    left: Tensor, right: Tensor, *, eps: float, iters: int, tol: float | None = None,
    cost_normalization: CostNormalization = "none", detach_normalizer: bool = False,
    gradient: Gradient = "implicit",
) -> tuple[Tensor, Tensor]:
    """(``−1/B Σ_i log(B Π_ii)``, row-marginal L1 error) for row-aligned left (B, d), right (B, d)."""
    batch = left.shape[0]
    cost = normalize_cost(pairwise_euclidean(left, right), cost_normalization, detach=detach_normalizer)
    log_plan = sinkhorn_log_plan(cost, eps=eps, iters=iters, tol=tol, gradient=gradient)
    loss = -(log_plan.diagonal() + math.log(batch)).mean()
    error = (log_plan.detach().logsumexp(-1).exp() - 1.0 / batch).abs().sum()
    return loss, error


class IOT(PairTerm):
    name = "iot"
    Config = IOTConfig

    def __init__(self, config: IOTConfig, env: BuildEnv) -> None:
        super().__init__()
        self.config = config

    def forward(self, pair: AlignedPair) -> dict[str, Tensor]:
        cfg = self.config
        loss, error = iot_loss(pair.left, pair.right, eps=cfg.eps, iters=cfg.iters, tol=cfg.tol,
                               cost_normalization=cfg.cost_normalization, detach_normalizer=cfg.detach_normalizer,
                               gradient=cfg.gradient)
        return {"iot_loss": loss, "iot_marginal_error": error}
