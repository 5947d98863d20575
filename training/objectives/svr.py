"""SupCLAP Support Vector Regularization (SVR): a contrastive term on displaced "support vectors".

Text→audio: ``û_i = (u_i − v_i)/‖u_i − v_i‖``, ``v_sup,i = v_i + R_i û_i`` (not re-normalized) and

    L_svr^{t2a} = −1/B Σ_i log softmax_j(v_sup,i · u_j / τ)[i]

(positive included in the denominator, SPEC §4.2). Audio→text is symmetric with
``u_sup,i = u_i + R_i (v_i − u_i)/‖v_i − u_i‖`` against the texts. Each direction is
weighted ½ like the base InfoNCE's directions (the paper sums its directions in both
``L_orig`` and ``L_svr``, so α keeps the paper's meaning):

    L = L_base + α · ½ Σ_{dir} L_svr^{dir} + β L_cons,
    L_cons = mean_i ReLU(R_i − ‖u_i − v_i‖) + ReLU(−R_i)          (dynamic radius only)

The radius R is one learnable scalar (``static``) or, per row, a 3-layer MLP on the
row's cosine-similarity vector ``[S_ii, negatives sorted descending]`` padded with −1
(an infinitely easy negative) or cut to ``width`` (``dynamic``). The MLP sees detached
similarities and the constraint a detached distance: both only train the radius, never
push the encoders. With R fixed, ``∂v_sup/∂v = I − (R/‖u−v‖)(I − ûûᵀ)``: each negative's
push keeps its part along û and has its perpendicular part scaled by ``1 − R/‖u−v‖``.

Args:
    radius: ``static`` | ``dynamic``.
    direction: ``uni`` (text→audio) | ``bi`` (both directions).
    init_radius: initial R (static scalar; dynamic: the MLP's initial output), default 0.1.
    alpha: weight α of L_svr, default 1.
    beta: weight β of L_cons (dynamic only; 0 = the paper's "wo/ constraints"), default 0.01.
    tau: temperature τ of L_svr (logit scale = 1/τ), default 0.07.
    learnable_tau: learn τ (log-parameterized) instead of fixing it.
    width: input width of the radius MLP (similarity vectors are padded/cut to it).
    hidden: hidden width of the radius MLP.

Shapes: pair.left = audio u (B, d), pair.right = text v (B, d), L2-normalized → scalars;
R is () (static) or (B,) (dynamic).

References: Luo, Yin et al., "SupCLAP" — Eq. 6 (SVR term), Eq. 9 (total with constraint),
Eq. 13–16 (Jacobian and force decomposition), §3.2 (static/dynamic radius), App. B (L_cons),
§4.3/Fig. 3 (mean radius per epoch, returned by :meth:`SupportVectorRegularizer.epoch_summary`).

Relations: a regularizer on audio–text pairs on top of any base (:mod:`.infonce`,
:mod:`.siglip`) and any strategy (:mod:`.random_language`, :mod:`.kcl`, :mod:`.cacl`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from training.objectives.base import AlignedPair, BuildEnv, PairTerm, TermConfig
from training.objectives.temperature import Temperature

_EPS = 1e-8


class SVRConfig(TermConfig):
    radius: Literal["static", "dynamic"] = "static"
    direction: Literal["uni", "bi"] = "bi"
    init_radius: float = 0.1
    alpha: float = Field(1.0, ge=0)
    beta: float = Field(0.01, ge=0)
    tau: float = Field(0.07, gt=0)
    learnable_tau: bool = False
    width: int = Field(256, ge=2)
    hidden: int = Field(128, ge=1)


def support_vectors(anchor: Tensor, positive: Tensor, radius: Tensor) -> tuple[Tensor, Tensor]:
    """(``anchor + R · (positive − anchor)/‖positive − anchor‖``, the distances ‖positive − anchor‖).

    ``anchor``, ``positive`` (B, d); ``radius`` () or (B,). Not re-normalized (SPEC §4.2).
    """
    diff = positive - anchor
    dist = diff.norm(dim=-1)
    direction = diff / dist.clamp_min(_EPS).unsqueeze(-1)
    return anchor + radius.reshape(-1, 1) * direction, dist


def similarity_features(similarity: Tensor, width: int) -> Tensor:
    """Rows ``[S_ii, negatives of row i sorted descending]`` padded with −1 or cut to ``width``.

    ``similarity`` (B, B) with the positives on the diagonal → (B, width).
    """
    size = similarity.shape[0]
    eye = torch.eye(size, dtype=torch.bool, device=similarity.device)
    negatives = similarity.masked_fill(eye, float("-inf")).sort(dim=1, descending=True).values[:, :-1]
    features = torch.cat([similarity.diagonal().unsqueeze(1), negatives], dim=1)
    if features.shape[1] >= width:
        return features[:, :width]
    return F.pad(features, (0, width - features.shape[1]), value=-1.0)


class RadiusPredictor(nn.Module):
    """DynamicSVR's 3-layer MLP ``f_θ``: similarity vector (B, width) → radius (B,)."""

    def __init__(self, *, width: int, hidden: int, init_radius: float) -> None:
        super().__init__()
        self.width = width
        self.mlp = nn.Sequential(
            nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )
        last = self.mlp[-1]
        nn.init.zeros_(last.weight)  # starts at exactly init_radius; the weights still get gradients
        nn.init.constant_(last.bias, init_radius)

    def forward(self, similarity: Tensor) -> Tensor:
        return self.mlp(similarity_features(similarity.detach(), self.width)).squeeze(-1)


class SupportVectorRegularizer(PairTerm):
    name = "svr"
    Config = SVRConfig
    kinds = frozenset({"audio-text"})

    def __init__(self, config: SVRConfig, env: BuildEnv) -> None:
        super().__init__()
        self.config = config
        self.temperature = Temperature(config.tau, learnable=config.learnable_tau)
        if config.radius == "static":
            self.radius = nn.Parameter(torch.tensor(float(config.init_radius)))
        else:
            self.predictor = RadiusPredictor(width=config.width, hidden=config.hidden, init_radius=config.init_radius)
        self.register_buffer("_radius_sum", torch.zeros(()), persistent=False)
        self._radius_count = 0

    def _radii(self, similarity: Tensor) -> Tensor:
        """Radius per row of `similarity` (rows = anchors, columns = candidates)."""
        if self.config.radius == "static":
            return self.radius.expand(similarity.shape[0])
        return self.predictor(similarity)

    def _direction(self, anchor: Tensor, positive: Tensor, similarity: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(L_svr for anchors→positives, L_cons, radii) of one direction."""
        radius = self._radii(similarity)
        support, dist = support_vectors(anchor, positive, radius)
        logits = self.temperature.scale() * support @ positive.t()
        targets = torch.arange(anchor.shape[0], device=anchor.device)
        loss = F.cross_entropy(logits, targets)
        cons = (F.relu(radius - dist.detach()) + F.relu(-radius)).mean()
        return loss, cons, radius

    def forward(self, pair: AlignedPair) -> dict[str, Tensor]:
        audio, text = pair.left, pair.right
        similarity = audio @ text.t()
        # text→audio: anchors are texts, their candidates the audios (rows of Sᵀ).
        directions = [self._direction(text, audio, similarity.t())]
        if self.config.direction == "bi":
            directions.append(self._direction(audio, text, similarity))
        svr = 0.5 * sum(d[0] for d in directions)
        radii = torch.cat([d[2].reshape(-1) for d in directions])
        out = {"svr_loss": self.config.alpha * svr, "svr_radius": radii.mean().detach()}
        if self.config.radius == "dynamic" and self.config.beta > 0:
            cons = sum(d[1] for d in directions) / len(directions)
            out["svr_cons_loss"] = self.config.beta * cons
        if self.training:
            self._radius_sum += out["svr_radius"]
            self._radius_count += 1
        return out

    def epoch_summary(self) -> dict[str, float]:
        """``svr_mean_radius``: mean radius over the epoch's batches (SupCLAP Fig. 3), then reset."""
        if self._radius_count == 0:
            return {}
        mean = float(self._radius_sum) / self._radius_count
        self._radius_sum.zero_()
        self._radius_count = 0
        return {"svr_mean_radius": mean}
