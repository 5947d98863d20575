"""Built-in text tower (SPEC §3): a small pre-LN transformer encoder over BPE tokens.

Token + learned positional embeddings → ``layers`` pre-LN blocks
(``x + Attn(LN(x))``, ``x + MLP(LN(x))``, MLP width 2×) → final LayerNorm →
mean pooling over the attention mask (or the first token, ``<s>``, for
``pooling: cls``). Padded positions never influence real tokens (additive
attention mask), so trimming trailing padding does not change the output.
Defaults (width 192, 3 layers, 4 heads, vocab 4000) ≈ 1.7 M parameters.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from training.config import TextTowerConfig
from training.models.checkpointing import run_block

MLP_RATIO = 2
"""Hidden width of the MLP as a multiple of ``width`` (2 rather than the usual 4: a third
less compute per token for templated captions; measured in docs/models.md)."""
MASK_VALUE = -1e9
"""Additive attention bias for padded keys (finite: a fully padded row stays NaN-free)."""


class SelfAttention(nn.Module):
    """Multi-head self-attention with an additive key-padding bias."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"model.text.width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(w // self.heads))
        attn = torch.softmax(scores + bias, dim=-1)
        return self.out(torch.matmul(attn, v).transpose(1, 2).reshape(b, n, w))


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, MLP_RATIO * width), nn.GELU(), nn.Linear(MLP_RATIO * width, width)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), bias))
        return x + self.drop(self.mlp(self.norm2(x)))


def masked_mean(hidden: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``hidden`` (B, L, D) over positions where ``mask`` (B, L) is 1."""
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


class TextTransformer(nn.Module):
    """(input_ids (B, L), attention_mask (B, L)) → pooled features (B, ``out_dim``)."""

    def __init__(self, cfg: TextTowerConfig, *, vocab_size: int) -> None:
        super().__init__()
        self.pooling = cfg.pooling
        self.token_emb = nn.Embedding(vocab_size, cfg.width)
        self.pos_emb = nn.Parameter(torch.zeros(cfg.max_length, cfg.width))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg.width, cfg.heads, cfg.dropout) for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.width)
        self.out_dim = cfg.width
        self.checkpoint_blocks = False
        """Recompute each block in the backward pass (optim.text.gradient_checkpointing)."""
        nn.init.normal_(self.token_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb, std=0.02)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        length = input_ids.shape[1]
        x = self.drop(self.token_emb(input_ids) + self.pos_emb[:length])
        bias = (1.0 - attention_mask.to(x.dtype))[:, None, None, :] * MASK_VALUE
        for block in self.blocks:
            x = run_block(block, x, bias, enabled=self.checkpoint_blocks)
        x = self.norm(x)
        if self.pooling == "cls":
            return x[:, 0]
        return masked_mean(x, attention_mask)
