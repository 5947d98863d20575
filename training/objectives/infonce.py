"""Symmetric InfoNCE (NT-Xent), the CLAP baseline.

``L = ½ [CE(S/τ, I) + CE(Sᵀ/τ, I)]`` with ``S_ij = left_i · right_j``: the mean of the
left→right (audio→text) and right→left (text→audio) cross-entropies whose targets
are the diagonal.

Args:
    tau: temperature τ (logit scale = 1/τ), default 0.07.
    learnable_tau: learn τ through ``log(1/τ)`` (CLIP/CLAP practice) instead of fixing it.

Shapes: pair.left (B, d), pair.right (B, d), both L2-normalized → scalar.

References: van den Oord et al. 2018 (CPC, Eq. 4); CLAP (Elizalde et al. 2023);
the correspondence paper's ``L_sup`` (Eq. 1–2, τ = 0.05); ATRI Eq. 1–3.

Relations: the base every other contrastive objective extends (SVR adds a term,
KCL/CACL change the pairs, distillation replaces the one-hot targets).
"""

from __future__ import annotations

import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from training.objectives.base import AlignedPair, BuildEnv, PairTerm, TermConfig, row_mean
from training.objectives.temperature import Temperature


def symmetric_cross_entropy(pair: AlignedPair, scale: Tensor,
                            positive_offset: Tensor | float = 0.0) -> tuple[Tensor, Tensor]:
    """(left→right, right→left) mean cross-entropies of ``scale · left rightᵀ`` with diagonal targets.

    Only the rows of ``pair.query_rows()`` are scored (all of them outside local-loss
    mode, where the logits are the full B × B matrix and its transpose).
    ``positive_offset`` is added to each row's target logit (SupCLAP's simple
    reweighting adds ``log γ`` there, :mod:`.reweight`).
    """
    rows = pair.query_rows()
    left_logits = scale * pair.left[rows] @ pair.right.t()
    right_logits = scale * pair.right[rows] @ pair.left.t()
    if not (isinstance(positive_offset, float) and positive_offset == 0.0):
        on_target = F.one_hot(rows, pair.left.shape[0]).to(left_logits.dtype)
        left_logits = left_logits + positive_offset * on_target
        right_logits = right_logits + positive_offset * on_target
    left_to_right = F.cross_entropy(left_logits, rows, reduction="none")
    right_to_left = F.cross_entropy(right_logits, rows, reduction="none")
    return row_mean(left_to_right, pair), row_mean(right_to_left, pair)


class InfoNCEConfig(TermConfig):
    tau: float = Field(0.07, gt=0)
    learnable_tau: bool = True


class InfoNCE(PairTerm):
    name = "infonce"
    Config = InfoNCEConfig
    supports_local_loss = True

    def __init__(self, config: InfoNCEConfig, env: BuildEnv) -> None:
        super().__init__()
        self.temperature = Temperature(config.tau, learnable=config.learnable_tau)

    def forward(self, pair: AlignedPair) -> dict[str, Tensor]:
        left_to_right, right_to_left = symmetric_cross_entropy(pair, self.temperature.scale())
        return {
            "infonce_loss": 0.5 * (left_to_right + right_to_left),
            "tau": self.temperature.tau().detach(),
        }
