"""Unbalanced Wasserstein distance between feature channels (DART's feature-level regularizer).

Columns of the batch are distributions: ``C^F_ij = ‖U[:, i] − V[:, j]‖₂`` (d × d).
``P = argmin_{P ≥ 0} ⟨C^F, P⟩ + ε KL(P ‖ a bᵀ) + ρ KL(P1 ‖ a) + ρ KL(Pᵀ1 ‖ b)``
(log-domain scaling, **P detached**), ``L_UWD = ⟨C^F, P⟩``; this term returns
``λ L_UWD`` so that the loop's sum is DART's ``L_IOT + λ L_UWD`` (Eq. 14).

Marginals ``a = b`` are uniform (``1/d``, "DART w/o RAM") or reliability-aware (RAM):
``r_j = σ(corr_j − var_j − kurt_j)`` per channel, with the Pearson correlation of the
audio and text column, the sum of their variances and the sum of their kurtoses
``E[(z − μ)⁴]/σ⁴`` (computed on detached embeddings), smoothed by an EMA
``r ← β r + (1 − β) r̂`` across steps (the batch statistic of each step averaged
across ranks) and normalised ``r / Σ r``. The ``marginals`` switch selects the rows
of the paper's Table 5: ``uniform``, ``corr`` (σ(corr)), ``emavar`` (σ(−var)),
``kurt`` (σ(−kurt)), ``ram`` (all three). Two more rows come from the paper's Table 8
(Appendix I), where each side gets its *own* marginal straight from the batch (no
sigmoid, no EMA): ``l2norm`` (``a_j ∝ ‖U[:, j]‖₂``, ``b_j ∝ ‖V[:, j]‖₂``: larger
channels carry more mass) and ``variance`` (``a_j ∝ Var(U[:, j])``, ``b_j ∝ Var(V[:, j])``:
channels that vary across the batch carry more mass). Within a step each pair uses
``β r_prev + (1 − β) r̂_batch`` (Eq. 13 on the local batch); the shared state is
committed at the next ``on_step_start``.

Args:
    weight: λ (default 0.5).
    eps: entropic ε (default 0.03). reg_m: marginal relaxation τ/ρ (default 0.05).
    iters, tol: scaling iterations and early-stop tolerance.
    reg_type: reference of the entropic term (``kl`` = ``a bᵀ``, POT's default; ``entropy`` = ``1 1ᵀ``).
    marginals: ``uniform | corr | emavar | kurt | ram | l2norm | variance`` (default ``ram``).
    ema: β of the reliability EMA (default 0.9).

Shapes: pair.left (B, d) audio, pair.right (B, d) text → scalar ``uwd_loss``; logs
``uwd_cost`` (unweighted ⟨C, P⟩), ``uwd_mass`` (Σ P) and ``ram_entropy`` (entropy of the audio-side
marginal / log d; 1 = uniform).

References: DART Eq. 6–9 (feature cost, UWD), Eq. 10–13 and Appendix B Eq. 18–22
(RAM, EMA β = 0.9), Eq. 14 (total, λ = 0.5), Table 5 (marginal variants), Table 8
(L2-norm and variance marginals), Table 6
(ε = 0.03, τ = 0.05); SPEC §4.5.

Relations: regularizer on audio–text pairs only (text–text pairs of CACL are
skipped); pairs with :mod:`.iot` in DART, composes with any base loss (DART Table 11).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from training.distributed import all_reduce_mean
from training.objectives.base import AlignedPair, BuildEnv, PairTerm, TermConfig, TrainingContext
from training.ot import pairwise_euclidean, sinkhorn_unbalanced_log

MarginalKind = Literal["uniform", "corr", "emavar", "kurt", "ram", "l2norm", "variance"]
# Table 8's marginals: one per side, from the batch itself (no reliability score, no EMA).
_SIDE_MARGINALS = frozenset({"l2norm", "variance"})
_STATISTIC_SIGNS: dict[str, dict[str, float]] = {
    "corr": {"corr": 1.0},
    "emavar": {"var": -1.0},
    "kurt": {"kurt": -1.0},
    "ram": {"corr": 1.0, "var": -1.0, "kurt": -1.0},
}


class UWDConfig(TermConfig):
    weight: float = Field(0.5, ge=0)
    eps: float = Field(0.03, gt=0)
    reg_m: float = Field(0.05, gt=0)
    iters: int = Field(50, ge=1)
    tol: float | None = Field(1e-4, gt=0)
    reg_type: Literal["kl", "entropy"] = "kl"
    marginals: MarginalKind = "ram"
    ema: float = Field(0.9, ge=0, lt=1)


def channel_statistics(u: Tensor, v: Tensor, *, eps: float = 1e-8) -> dict[str, Tensor]:
    """Per-channel corr, var and kurt of audio u (B, d) and text v (B, d) → three (d,) tensors (Eq. 18–20)."""
    du, dv = u - u.mean(0), v - v.mean(0)
    var_u, var_v = du.pow(2).mean(0), dv.pow(2).mean(0)
    corr = (du * dv).mean(0) / (var_u.sqrt() * var_v.sqrt() + eps)
    kurt_u = du.pow(4).mean(0) / (var_u.pow(2) + eps)
    kurt_v = dv.pow(4).mean(0) / (var_v.pow(2) + eps)
    return {"corr": corr, "var": var_u + var_v, "kurt": kurt_u + kurt_v}


def side_marginals(u: Tensor, v: Tensor, marginals: MarginalKind, *, eps: float = 1e-12) -> tuple[Tensor, Tensor]:
    """Table 8's per-side marginals ``(a, b)`` (each (d,), summing to 1) for ``l2norm`` or ``variance``."""
    if marginals == "l2norm":
        a, b = u.norm(dim=0), v.norm(dim=0)
    elif marginals == "variance":
        a, b = u.var(dim=0, unbiased=False), v.var(dim=0, unbiased=False)
    else:
        raise ValueError(f"{marginals!r} is not a per-side marginal; use one of {sorted(_SIDE_MARGINALS)}")
    a, b = a + eps, b + eps  # a dead channel keeps a sliver of mass, so the KL terms stay finite
    return a / a.sum(), b / b.sum()


def batch_reliability(u: Tensor, v: Tensor, marginals: MarginalKind) -> Tensor:
    """The batch reliability ``r̂`` (d,) of Eq. 10 (or a Table 5 variant); ones for ``uniform``."""
    if marginals == "uniform":
        return torch.ones(u.shape[1], dtype=u.dtype, device=u.device)
    stats = channel_statistics(u, v)
    score = sum(sign * stats[key] for key, sign in _STATISTIC_SIGNS[marginals].items())
    return torch.sigmoid(score)  # type: ignore[arg-type]


class ReliabilityEMA(nn.Module):
    """EMA of channel reliabilities across steps (Eq. 13), averaged over ranks at each commit.

    All state is in buffers (saved with the objective, so a resumed run continues exactly).
    """

    def __init__(self, dim: int, *, beta: float) -> None:
        super().__init__()
        self.beta = beta
        self.register_buffer("value", torch.zeros(dim))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self.register_buffer("pending_sum", torch.zeros(dim))
        self.register_buffer("pending_count", torch.zeros(()))

    def blend(self, r_hat: Tensor) -> Tensor:
        """``β r_prev + (1 − β) r̂`` (``r̂`` alone before the first commit)."""
        if not bool(self.initialized):
            return r_hat
        return self.beta * self.value.to(r_hat) + (1 - self.beta) * r_hat

    def observe(self, r_hat: Tensor) -> None:
        """Remember this pair's batch statistic for the next commit."""
        self.pending_sum.add_(r_hat.detach().to(self.pending_sum))
        self.pending_count.add_(1.0)

    def commit(self) -> None:
        """Average the step's statistics over pairs and ranks, then apply the EMA update.

        Every rank must call this once per step (it holds the collective), even when it saw no pair.
        """
        packed = all_reduce_mean(torch.cat([self.pending_sum, self.pending_count.reshape(1)]))
        self.pending_sum.zero_()
        self.pending_count.zero_()
        count = float(packed[-1])
        if count <= 0:
            return
        r_step = packed[:-1] / count
        if bool(self.initialized):
            self.value.mul_(self.beta).add_((1 - self.beta) * r_step)
        else:
            self.value.copy_(r_step)
            self.initialized.fill_(True)


class UWD(PairTerm):
    name = "uwd"
    Config = UWDConfig
    kinds = frozenset({"audio-text"})

    def __init__(self, config: UWDConfig, env: BuildEnv) -> None:
        super().__init__()
        self.config = config
        self.reliability = ReliabilityEMA(env.embed_dim, beta=config.ema)

    def marginals(self, u: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The channel marginals ``(a, b)`` of this batch: Table 8's per-side ones, else ``a = b``."""
        if self.config.marginals in _SIDE_MARGINALS:
            return side_marginals(u.detach().float(), v.detach().float(), self.config.marginals)
        shared = self.marginal(u, v)
        return shared, shared

    def marginal(self, u: Tensor, v: Tensor) -> Tensor:
        """The channel marginal ``a = b = r / Σ r`` (d,) for this batch (records r̂ for the EMA)."""
        r_hat = batch_reliability(u.detach().float(), v.detach().float(), self.config.marginals)
        if self.config.marginals == "uniform":
            return r_hat / r_hat.sum()
        if self.training:
            self.reliability.observe(r_hat)
        r = self.reliability.blend(r_hat)
        return r / r.sum()

    def forward(self, pair: AlignedPair) -> dict[str, Tensor]:
        cfg = self.config
        u, v = pair.left, pair.right
        cost = pairwise_euclidean(u.t(), v.t())
        source, target = self.marginals(u, v)
        with torch.no_grad():
            plan = sinkhorn_unbalanced_log(
                cost.detach(), source.to(cost), target.to(cost), eps=cfg.eps, reg_m=cfg.reg_m, iters=cfg.iters, tol=cfg.tol,
                reg_type=cfg.reg_type,
            )
        uwd = (cost * plan).sum()
        entropy = -(source * source.clamp(min=1e-30).log()).sum() / math.log(source.numel())
        return {
            "uwd_loss": cfg.weight * uwd,
            "uwd_cost": uwd.detach(),
            "uwd_mass": plan.sum(),
            "ram_entropy": entropy.detach(),
        }

    def on_step_start(self, context: TrainingContext) -> None:
        if self.config.marginals not in _SIDE_MARGINALS | {"uniform"}:
            self.reliability.commit()
