"""Built-in audio tower (SPEC §3): a small, fast 2-D CNN on the log-mel spectrogram.

Layout (defaults: 64 mels, 5 s → 501 frames, ``channels=[32, 64, 128, 192]``)::

    log-mel (B, 64, 501)
    → per-mel BatchNorm (standardises the features; PANNs' ``bn0``)
    → right-pad 3 frames, average-pool time ×4 (40 ms steps: cheap, keeps
      transients' energy)
    → one conv3×3–BN–ReLU block per entry of ``channels``, each stride 2
      (B, 192, 4, 8): frequency and time both /16 after the pooling
    → frequency bands flattened into channels, 1×1 conv to ``channels[-1]``
    → two residual dilated temporal conv blocks (dilation 1, 2): context of
      several seconds for "A then B" relations
    → mean ‖ max pooling over time → (B, 2 · channels[-1])

Forward + backward ≈ 5.4 ms CPU per 5-s clip on one thread, frontend included
(≈ 3–3.5 ms wall on two idle threads; see docs/models.md). Works for any number
of frames ≥ 1 (padding keeps every stage non-empty), so the ONNX export accepts
dynamic lengths.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor, nn

from training.config import AudioTowerConfig, FrontendConfig
from training.models.checkpointing import run_block
from training.models.frontend import LogMelFrontend

TIME_POOL = 4
"""Time average-pooling factor before the first conv block."""


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    """3×3 conv (stride 2 in both axes) + BatchNorm + ReLU."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class TemporalBlock(nn.Module):
    """Residual dilated 1-D conv over time: ``x + ReLU(BN(conv(x)))``."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(
            channels, channels, kernel_size=3, padding=dilation, dilation=dilation, bias=False
        )
        self.norm = nn.BatchNorm1d(channels)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


def _halved(size: int, times: int) -> int:
    """Output size of ``times`` stride-2, kernel-3, padding-1 convolutions."""
    for _ in range(times):
        size = (size - 1) // 2 + 1
    return size


class AudioCNN(nn.Module):
    """waveform (B, T) → pooled features (B, ``out_dim``); frontend included."""

    def __init__(self, cfg: AudioTowerConfig, frontend_cfg: FrontendConfig) -> None:
        super().__init__()
        if not cfg.channels:
            raise ValueError("model.audio.channels must list at least one width")
        self.frontend = LogMelFrontend(frontend_cfg)
        self.input_norm = nn.BatchNorm1d(frontend_cfg.n_mels)
        self.time_pool = nn.AvgPool2d(kernel_size=(1, TIME_POOL))
        widths = [1, *cfg.channels]
        self.blocks = nn.Sequential(*(conv_block(a, b) for a, b in pairwise(widths)))
        width = cfg.channels[-1]
        bands = _halved(frontend_cfg.n_mels, len(cfg.channels))
        self.merge_bands = nn.Sequential(
            nn.Conv1d(width * bands, width, kernel_size=1, bias=False),
            nn.BatchNorm1d(width),
            nn.ReLU(inplace=True),
        )
        self.temporal = nn.Sequential(TemporalBlock(width, 1), TemporalBlock(width, 2))
        self.out_dim = 2 * width
        self.checkpoint_blocks = False
        """Recompute each block in the backward pass (optim.audio.gradient_checkpointing)."""

    def forward(self, waveform: Tensor) -> Tensor:
        x = self.input_norm(self.frontend(waveform))  # (B, M, F)
        # Zero (= the normalised mean) right padding so that any F >= 1 keeps >= 1 pooled step.
        x = nn.functional.pad(x, (0, TIME_POOL - 1))
        x = self.time_pool(x.unsqueeze(1))
        for block in self.blocks:
            x = run_block(block, x, enabled=self.checkpoint_blocks)  # (B, C, M', F')
        x = self.merge_bands(x.flatten(1, 2))  # (B, C, F')
        for block in self.temporal:
            x = run_block(block, x, enabled=self.checkpoint_blocks)
        return torch.cat([x.mean(dim=-1), x.amax(dim=-1)], dim=-1)
