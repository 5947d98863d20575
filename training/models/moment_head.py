"""The temporal moment head: a small conv net over a recording's frozen window embeddings,
conditioned on the query's text embedding (objective and equations: training/objectives/moment_span.py).

Input per window ``t``: ``[w_t ⊙ q, w_t · q]`` (the window embedding gated by the text, and
their cosine — the sliding-window baseline's score is an input, so the head starts from it),
projected to ``hidden``, then ``layers`` residual 1-D convolutions (kernel 5: ±2 windows of
context, what AM-DETR's self-attention over the audio sequence gives at this scale), then a
linear layer to ``(p_t, l_t, r_t)``: relevance logit and softplus distances (seconds) from the
window's centre to the moment's start and end, scaled by the window length.

Exported to ONNX (``moment_head.onnx``: inputs ``windows`` (1, T, d), ``text`` (1, d); outputs
``logits`` (1, T), ``distances`` (1, T, 2)); the torch-free path is :mod:`index.moments.head`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MomentHead(nn.Module):
    def __init__(self, embed_dim: int, *, hidden: int = 64, layers: int = 2, window_seconds: float = 1.0) -> None:
        super().__init__()
        self.window_seconds = float(window_seconds)
        self.project = nn.Linear(embed_dim + 1, hidden)
        self.convs = nn.ModuleList(nn.Conv1d(hidden, hidden, 5, padding=2) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, 3)

    def forward(self, windows: Tensor, text: Tensor) -> tuple[Tensor, Tensor]:
        """windows (B, T, d), text (B, d) → logits (B, T), distances (B, T, 2) in seconds."""
        q = text[:, None, :]
        cosine = (windows * q).sum(-1, keepdim=True)
        x = F.gelu(self.project(torch.cat([windows * q, cosine], dim=-1)))
        for conv, norm in zip(self.convs, self.norms, strict=True):
            x = norm(x + F.gelu(conv(x.transpose(1, 2)).transpose(1, 2)))
        out = self.out(x)
        return out[..., 0], F.softplus(out[..., 1:]) * self.window_seconds
