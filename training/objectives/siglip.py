"""SigLIP pairwise sigmoid loss.

``L = −1/B Σ_ij log σ(z_ij (t · S_ij + b))`` with ``z_ii = +1`` and ``z_ij = −1`` otherwise.
Each pair is an independent binary classification, so no softmax over the batch.

Args:
    init_scale: initial ``t`` (stored as ``log t``, learnable), default 10.
    init_bias: initial ``b`` (learnable), default −10.

Shapes: pair.left (B, d), pair.right (B, d) → scalar.

References: Zhai et al. 2023, "Sigmoid Loss for Language Image Pre-Training", Eq. 1
(SPEC §4.1 fixes the initialisation).

Relations: alternative base loss to :mod:`.infonce`; composes with every strategy
and regularizer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.objectives.base import AlignedPair, BuildEnv, PairTerm, TermConfig, row_mean


class SigLIPConfig(TermConfig):
    init_scale: float = 10.0
    init_bias: float = -10.0
    learnable: bool = True


class SigLIP(PairTerm):
    name = "siglip"
    Config = SigLIPConfig
    supports_local_loss = True

    def __init__(self, config: SigLIPConfig, env: BuildEnv) -> None:
        super().__init__()
        if config.init_scale <= 0:
            raise ValueError("siglip init_scale must be positive")
        self.log_scale = nn.Parameter(torch.tensor(math.log(config.init_scale)), requires_grad=config.learnable)
        self.bias = nn.Parameter(torch.tensor(config.init_bias), requires_grad=config.learnable)

    def forward(self, pair: AlignedPair) -> dict[str, Tensor]:
        rows = pair.query_rows()  # every row, or this process's rows in local-loss mode
        logits = self.log_scale.exp() * pair.left[rows] @ pair.right.t() + self.bias
        signs = -torch.ones_like(logits)
        signs[torch.arange(rows.numel(), device=rows.device), rows] = 1.0
        loss = row_mean(-F.logsigmoid(signs * logits).sum(dim=1), pair)
        return {"siglip_loss": loss, "siglip_scale": self.log_scale.exp().detach()}
