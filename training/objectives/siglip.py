"""SigLIP pairwise sigmoid loss.

``L = −1/B Σ_ij log σ(z_ij (t · S_ij + b))`` with ``z_ii = +1`` and ``z_ij = −1`` otherwise.
Each pair is an independent binary classification, so no softmax over the batch.

Initialisation. The paper's ``t = 10, b = −10`` were chosen for a 32k batch, where one pair in
32,000 is positive. At a small batch they start the model far from the class prior, and with a
short run Adam moves each scalar by ~0.1 in total (seen at batch 64: b −10 → −9.99). So by
default the initialisation depends on the batch: ``t = 1/τ₀`` (τ₀ = 0.07, InfoNCE's temperature)
and ``b = −log B`` with B the candidates each query is scored against (the batch; the global batch
in local-loss mode), i.e. ``σ(b) ≈ 1/B``: at ``S = 0`` the model predicts the prior of a positive.
The bias is stored as an offset ``b₀`` and used as ``b = b₀ − log B``, so it needs no batch size
when built and follows the batch it is given (gradients are those of a plain ``b``).

Args:
    init_scale: initial ``t`` (stored as ``log t``, learnable); default ``None`` = ``1/tau0``.
    tau0: τ₀ of the default ``t`` (default 0.07).
    init_bias: initial ``b``; default ``None`` = ``−log B`` (above). The paper's values stay
        selectable: ``init_scale: 10, init_bias: -10``.
    learnable: learn t and b (default true).

Shapes: pair.left (B, d), pair.right (B, d) → scalar; logs ``siglip_scale`` and ``siglip_bias``.

References: Zhai et al. 2023, "Sigmoid Loss for Language Image Pre-Training", Eq. 1 and §3.2
(t' = log 10, b = −10 for their batch); SPEC §4.1; docs/objectives.md ("SigLIP initialisation").

Relations: alternative base loss to :mod:`.infonce`; composes with every strategy
and regularizer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from training.objectives.base import AlignedPair, BuildEnv, PairTerm, TermConfig, row_mean


class SigLIPConfig(TermConfig):
    init_scale: float | None = Field(None, gt=0)
    tau0: float = Field(0.07, gt=0)
    init_bias: float | None = None
    learnable: bool = True


class SigLIP(PairTerm):
    name = "siglip"
    Config = SigLIPConfig
    supports_local_loss = True

    def __init__(self, config: SigLIPConfig, env: BuildEnv) -> None:
        super().__init__()
        scale = config.init_scale if config.init_scale is not None else 1.0 / config.tau0
        self.batch_prior = config.init_bias is None
        """True: the bias is an offset on −log B (the batch-dependent default)."""
        self.log_scale = nn.Parameter(torch.tensor(math.log(scale)), requires_grad=config.learnable)
        self.bias = nn.Parameter(torch.tensor(0.0 if config.init_bias is None else config.init_bias),
                                 requires_grad=config.learnable)

    def effective_bias(self, candidates: int) -> Tensor:
        """``b`` used against `candidates` texts per query: the offset minus log B, or the plain bias."""
        return self.bias - math.log(candidates) if self.batch_prior else self.bias

    def forward(self, pair: AlignedPair) -> dict[str, Tensor]:
        rows = pair.query_rows()  # every row, or this process's rows in local-loss mode
        bias = self.effective_bias(pair.right.shape[0])
        logits = self.log_scale.exp() * pair.left[rows] @ pair.right.t() + bias
        signs = -torch.ones_like(logits)
        signs[torch.arange(rows.numel(), device=rows.device), rows] = 1.0
        loss = row_mean(-F.logsigmoid(signs * logits).sum(dim=1), pair)
        return {"siglip_loss": loss, "siglip_scale": self.log_scale.exp().detach(), "siglip_bias": bias.detach()}
