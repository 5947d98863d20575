"""SupCLAP's "simple reweighting" baseline: InfoNCE with a learnable scale on the positive's probability.

SupCLAP's Appendix E.4 asks whether SVR is only gradient re-scaling, and compares it with a
learnable scalar ``γ`` that scales the positive probability ``P⁺`` of its Eq. 2. Scaling
``exp(s⁺)`` by ``γ`` inside the softmax is adding ``log γ`` to the positive logit::

    P̃⁺ = γ e^{s⁺} / (γ e^{s⁺} + Σ_j e^{s⁻_j}),   L = ½ [CE(S/τ + log γ · I) + CE(Sᵀ/τ + log γ · I)]

so the gradient with respect to a text is ``1/τ [(P̃⁺ − 1) a⁺ + Σ_j P̃⁻_j a⁻_j]`` (Eq. 4 with
P̃): only the *balance* between the pull and the push changes — each negative still pushes
along its own direction and the negatives keep their relative weights ``P̃⁻_j / P̃⁻_k =
P⁻_j / P⁻_k``, whereas SVR scales only the perpendicular part (Eq. 8). γ = 1 is plain
InfoNCE. The paper reports that the learnable scalar makes training unstable and loses
to InfoNCE (Table 7: A2T R@1 56.72 → 51.26); γ is log-parameterised and clamped to
``[1/max_gamma, max_gamma]`` so it cannot run off to infinity (a free γ lowers the loss
without improving the embeddings).

Args:
    tau, learnable_tau: as :mod:`.infonce`.
    init_gamma: initial γ (default 1, i.e. InfoNCE at step 0).
    learnable_gamma: learn γ (default true, as in the paper).
    max_gamma: clamp of γ and 1/γ (default 10).

Shapes: pair.left (B, d), pair.right (B, d) → scalar ``reweight_loss``; logs ``gamma``, ``tau``.

References: SupCLAP (support vector regularization), Eq. 2–4 and Appendix E.4, Table 7.

Relations: same pairs and temperature as :mod:`.infonce`; the control for :mod:`.svr`.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field
from torch import Tensor, nn

from training.objectives.base import AlignedPair, BuildEnv, PairTerm, TermConfig
from training.objectives.infonce import symmetric_cross_entropy
from training.objectives.temperature import Temperature


class ReweightConfig(TermConfig):
    tau: float = Field(0.07, gt=0)
    learnable_tau: bool = True
    init_gamma: float = Field(1.0, gt=0)
    learnable_gamma: bool = True
    max_gamma: float = Field(10.0, gt=1)


class SimpleReweight(PairTerm):
    name = "infonce_reweight"
    Config = ReweightConfig

    def __init__(self, config: ReweightConfig, env: BuildEnv) -> None:
        super().__init__()
        self.config = config
        self.temperature = Temperature(config.tau, learnable=config.learnable_tau)
        log_gamma = torch.tensor(math.log(config.init_gamma))
        if config.learnable_gamma:
            self.log_gamma = nn.Parameter(log_gamma)
        else:
            self.register_buffer("log_gamma", log_gamma)

    def gamma_log(self) -> Tensor:
        bound = math.log(self.config.max_gamma)
        return self.log_gamma.clamp(-bound, bound)

    def forward(self, pair: AlignedPair) -> dict[str, Tensor]:
        left_to_right, right_to_left = symmetric_cross_entropy(
            pair, self.temperature.scale(), positive_offset=self.gamma_log())
        return {
            "reweight_loss": 0.5 * (left_to_right + right_to_left),
            "gamma": self.gamma_log().exp().detach(),
            "tau": self.temperature.tau().detach(),
        }
