"""Boundary-aware moment objective of the temporal head — objective ``moment_span``.

Trains :class:`training.models.moment_head.MomentHead`, a light temporal model over a
recording's *frozen* window embeddings conditioned on the query's text embedding, which
predicts for every window ``t`` a relevance logit ``p_t`` and the distances ``(l_t, r_t)``
(seconds, ≥ 0) from the window's centre ``c_t`` to the moment's start and end, so window
``t`` proposes the span ``b̂_t = [c_t − l_t, c_t + r_t]`` with score ``σ(p_t)``.

Reference: Munakata et al. 2024, "Language-based Audio Moment Retrieval" (AM-DETR; the
Clotho-Moment set; +9.00 Recall1@0.7 over the sliding-window baseline). AM-DETR inherits
Moment-DETR's loss (Lei et al. 2021, QVHighlights, §3.2), which this objective uses per
window instead of per Hungarian-matched query slot (a dense, anchor-per-window head rather
than a set-prediction decoder; the matching is replaced by "windows whose centre lies in a
ground-truth moment are its positives")::

    L = λ_cls · L_cls + λ_L1 · L_L1 + λ_gIoU · L_gIoU

    L_cls  = mean_t  BCE(σ(p_t), y_t)            y_t = 1 ⇔ c_t ∈ [s*, e*] of a ground-truth moment
                                                   (positives weighted by ``positive_weight``)
    L_L1   = mean_{t: y_t=1}  (|c_t − l_t − s*| + |c_t + r_t − e*|) / D      D = the recording's length
    L_gIoU = mean_{t: y_t=1}  1 − gIoU(b̂_t, [s*, e*])
    gIoU(a, b) = IoU(a, b) − (|C| − |a ∪ b|) / |C|,   C = the smallest span covering a and b

(the 1-D generalized IoU of Rezatofighi et al. 2019, as Moment-DETR writes it). The
spans' L1 is normalised by the recording length as Moment-DETR normalises spans to [0, 1].

Args:
    cls_weight, l1_weight, giou_weight: λ_cls, λ_L1, λ_gIoU (Moment-DETR: 4, 10, 1 with its
        own foreground CE; defaults here 1, 5, 1 were the first tried on the synthetic moments).
    positive_weight: weight of a positive window in L_cls (positives are a minority).

Shapes: logits (B, T), distances (B, T, 2), centres (B, T), targets (B, T, 2) seconds with
``positive`` (B, T) bool and ``valid`` (B, T) bool masks (padding), lengths (B,) → scalar terms.
``regress`` (B, T) bool, optional: the positives whose span enters L_L1 and L_gIoU (default: every
positive). training/moment_head.py leaves out the windows of a moment longer than the head sees
around a window (its far edges are out of the window's context: only that it is inside can be
learned, through L_cls).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from training.objectives.base import TermConfig


def generalized_iou_1d(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(IoU, gIoU) of row-aligned spans ``a`` and ``b`` of shape (..., 2)."""
    inter = (torch.minimum(a[..., 1], b[..., 1]) - torch.maximum(a[..., 0], b[..., 0])).clamp(min=0)
    union = (a[..., 1] - a[..., 0]) + (b[..., 1] - b[..., 0]) - inter
    iou = inter / union.clamp(min=1e-6)
    hull = torch.maximum(a[..., 1], b[..., 1]) - torch.minimum(a[..., 0], b[..., 0])
    return iou, iou - (hull - union) / hull.clamp(min=1e-6)


class MomentSpanConfig(TermConfig):
    cls_weight: float = Field(1.0, ge=0)
    l1_weight: float = Field(5.0, ge=0)
    giou_weight: float = Field(1.0, ge=0)
    positive_weight: float = Field(3.0, gt=0)


class MomentSpanLoss(nn.Module):
    name = "moment_span"
    Config = MomentSpanConfig

    def __init__(self, config: MomentSpanConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, logits: Tensor, distances: Tensor, centres: Tensor, targets: Tensor, positive: Tensor,
                valid: Tensor, lengths: Tensor, regress: Tensor | None = None) -> dict[str, Tensor]:
        c = self.config
        weight = valid.float() * torch.where(positive, c.positive_weight, 1.0)
        cls = (F.binary_cross_entropy_with_logits(logits, positive.float(), reduction="none") * weight).sum()
        cls = cls / weight.sum().clamp(min=1.0)
        spans = torch.stack([centres - distances[..., 0], centres + distances[..., 1]], dim=-1)
        pos = positive & valid if regress is None else regress & positive & valid
        count = pos.sum().clamp(min=1)
        l1 = ((spans - targets).abs().sum(-1) / lengths[:, None]) * pos
        _, giou = generalized_iou_1d(spans, targets)
        giou_loss = (1 - giou) * pos
        terms = {"moment_cls_loss": c.cls_weight * cls,
                 "moment_l1_loss": c.l1_weight * l1.sum() / count,
                 "moment_giou_loss": c.giou_weight * giou_loss.sum() / count}
        return terms
