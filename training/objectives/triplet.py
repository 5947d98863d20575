"""Bidirectional max-margin triplet loss, the sample-level baseline DART reports beside InfoNCE.

With ``S_ij = left_i · right_j`` (cosine similarities of L2-normalized embeddings) and margin m:

* ``hardest`` (VSE++, "triplet-max"): ``L = 1/B Σ_i [m − S_ii + max_{j≠i} S_ij]₊ + [m − S_ii + max_{j≠i} S_ji]₊``;
* ``sum`` ("triplet-sum"): the hinge summed over every negative instead of the hardest one.

The loss is zero exactly when every positive beats the (hardest) negatives of its row and
column by the margin, and with ``hardest`` only the hardest negative of each anchor gets a
gradient (Faghri et al. 2018, Eq. 3–5).

Args:
    margin: m (default 0.2, Mei et al. 2022 and VSE++).
    negatives: ``hardest`` (default) or ``sum``.

Shapes: pair.left (B, d), pair.right (B, d) → scalar ``triplet_loss``; logs
``triplet_active`` (fraction of anchors whose hinge is non-zero).

References: Faghri et al. 2018 (VSE++); Wei et al. 2021 and Mei et al. 2022 (triplet losses
for audio–text retrieval); DART (Guo, Tu & Xu) Tables 2, 4 and 11 ("Triplet loss" rows).

Relations: alternative base loss to :mod:`.infonce` and :mod:`.iot` (all three are IOT
instances in Shi et al. 2023); DART Table 11 adds :mod:`.uwd` on top of it.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from training.objectives.base import AlignedPair, BuildEnv, PairTerm, TermConfig


class TripletConfig(TermConfig):
    margin: float = Field(0.2, gt=0)
    negatives: Literal["hardest", "sum"] = "hardest"


def triplet_hinges(similarity: Tensor, *, margin: float, negatives: str) -> tuple[Tensor, Tensor]:
    """Per-anchor hinges (left→right, right→left), each (B,), of a square similarity matrix."""
    positive = similarity.diagonal()
    off_diagonal = ~torch.eye(similarity.shape[0], dtype=torch.bool, device=similarity.device)
    row = (margin - positive[:, None] + similarity).clamp(min=0) * off_diagonal
    column = (margin - positive[None, :] + similarity).clamp(min=0) * off_diagonal
    if negatives == "hardest":
        return row.max(dim=1).values, column.max(dim=0).values
    return row.sum(dim=1), column.sum(dim=0)


class Triplet(PairTerm):
    name = "triplet"
    Config = TripletConfig

    def __init__(self, config: TripletConfig, env: BuildEnv) -> None:
        super().__init__()
        self.config = config

    def forward(self, pair: AlignedPair) -> dict[str, Tensor]:
        left_to_right, right_to_left = triplet_hinges(
            pair.left @ pair.right.t(), margin=self.config.margin, negatives=self.config.negatives
        )
        active = torch.cat([left_to_right, right_to_left]) > 0
        return {
            "triplet_loss": (left_to_right + right_to_left).mean(),
            "triplet_active": active.float().mean().detach(),
        }
