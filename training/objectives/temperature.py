"""Fixed or learnable (log-parameterized) softmax temperature, shared by the InfoNCE family."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class Temperature(nn.Module):
    """τ stored as ``log(1/τ)`` so it stays positive; clamped to ``[1/max_scale, ∞)``.

    The logit scale is ``1/τ``: similarities are multiplied by it.
    """

    def __init__(self, tau: float, *, learnable: bool, max_scale: float = 100.0) -> None:
        super().__init__()
        if tau <= 0:
            raise ValueError(f"temperature must be positive, got {tau}")
        log_scale = torch.tensor(math.log(1.0 / tau))
        self.max_log_scale = math.log(max_scale)
        if learnable:
            self.log_scale = nn.Parameter(log_scale)
        else:
            self.register_buffer("log_scale", log_scale)

    def scale(self) -> Tensor:
        return self.log_scale.clamp(max=self.max_log_scale).exp()

    def tau(self) -> Tensor:
        return 1.0 / self.scale()
