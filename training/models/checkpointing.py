"""Activation checkpointing for the built-in towers (``optim.{audio,text}.gradient_checkpointing``).

A tower that sets ``checkpoint_blocks = True`` runs each block through
:func:`torch.utils.checkpoint.checkpoint` (non-reentrant, RNG state preserved, so dropout
draws the same masks in the recomputation): only the block inputs are kept for the
backward pass and each block's forward runs again there. BatchNorm layers inside a block
would count the recomputation as a second batch in their running statistics; the
recomputation puts them back, so the statistics (and the gradients) equal those of a run
without checkpointing (tests/training/test_activation_checkpointing.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


class _Recomputed:
    """Calls `block`; from the second call on (the backward's recomputation) BatchNorm statistics are restored."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.calls = 0

    def __call__(self, *args: Any) -> Tensor:
        self.calls += 1
        if self.calls == 1:
            out: Tensor = self.block(*args)
            return out
        saved = [
            (buffer, buffer.detach().clone())
            for layer in self.block.modules()
            if isinstance(layer, nn.modules.batchnorm._BatchNorm)
            for buffer in layer.buffers()
        ]
        try:  # torch stops a recomputation early by raising once it has what the backward needs
            out = self.block(*args)
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)
        return out


def run_block(block: nn.Module, *args: Any, enabled: bool) -> Tensor:
    """`block(*args)`, checkpointed when `enabled`, training and building a graph."""
    if not (enabled and block.training and torch.is_grad_enabled()):
        out: Tensor = block(*args)
        return out
    result: Tensor = checkpoint(_Recomputed(block), *args, use_reentrant=False)
    return result
