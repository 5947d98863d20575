"""Log-mel frontend (SPEC §2): waveform (B, T) → log-mel (B, n_mels, frames).

The same module runs in training and inside the exported ONNX audio encoder, so
training and serving compute the same features:

* training (eager) uses ``torch.stft`` (FFT, fast);
* ONNX export uses a windowed-DFT as ``conv1d`` with fixed cos/sin kernels, which
  every ONNX runtime executes identically. Both paths compute the same power
  spectrum (a parity test checks it), selected automatically by
  ``torch.onnx.is_in_onnx_export()`` or explicitly with ``use_dft``.

Padding policy ("center", zero padding): the waveform is zero-padded by
``n_fft // 2`` samples on both sides and frame ``t`` is centred on sample
``t * hop_length``, so any length ``T ≥ 1`` gives ``1 + T // hop_length`` frames
(501 frames for 5 s at 16 kHz, hop 160). The analysis window is a periodic Hann
window of ``win_length`` samples centred inside the ``n_fft`` frame (as
``torch.stft`` does). Features are ``log(mel_power + 1e-6)`` with an HTK-scale
triangular filterbank without area normalisation (torchaudio's default).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

from training.config import FrontendConfig

LOG_EPS = 1e-6
"""Added to the mel power before the log; log(LOG_EPS) is the value of digital silence."""


def hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    """HTK mel scale: ``2595 log10(1 + f / 700)``."""
    return 2595.0 * np.log10(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)


def mel_to_hz(mel: np.ndarray | float) -> np.ndarray:
    """Inverse of :func:`hz_to_mel`."""
    return 700.0 * (10.0 ** (np.asarray(mel, dtype=np.float64) / 2595.0) - 1.0)


def mel_filterbank(
    *, sample_rate: int, n_fft: int, n_mels: int, f_min: float, f_max: float
) -> np.ndarray:
    """Triangular HTK mel filterbank, shape (n_mels, n_fft // 2 + 1), float32.

    Filter ``m`` rises linearly from mel point ``m`` to ``m + 1`` and falls to
    ``m + 2`` (``n_mels + 2`` points equally spaced in mel between f_min and
    f_max); peak height 1 (no area normalisation), as torchaudio's default.
    """
    if not 0.0 <= f_min < f_max <= sample_rate / 2:
        raise ValueError(f"need 0 <= f_min < f_max <= sample_rate/2, got {f_min}, {f_max}")
    freqs = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    points = mel_to_hz(np.linspace(hz_to_mel(f_min), hz_to_mel(f_max), n_mels + 2))
    lower, center, upper = points[:-2, None], points[1:-1, None], points[2:, None]
    rising = (freqs[None, :] - lower) / (center - lower)
    falling = (upper - freqs[None, :]) / (upper - center)
    return np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)


def padded_hann_window(*, win_length: int, n_fft: int) -> np.ndarray:
    """Periodic Hann window of ``win_length`` centred in ``n_fft`` samples (zeros around)."""
    n = np.arange(win_length)
    window = 0.5 - 0.5 * np.cos(2.0 * math.pi * n / win_length)
    left = (n_fft - win_length) // 2
    out = np.zeros(n_fft)
    out[left : left + win_length] = window
    return out


def dft_kernels(*, win_length: int, n_fft: int) -> np.ndarray:
    """Windowed real-DFT kernels for conv1d, shape (2 * (n_fft//2 + 1), 1, win_length).

    Rows ``[0, F)`` are ``w[n] cos(2π k n / n_fft)``, rows ``[F, 2F)`` are
    ``-w[n] sin(...)``, restricted to the non-zero window taps (a frame of
    ``n_fft`` samples whose window is zero outside the central ``win_length``).
    """
    window = padded_hann_window(win_length=win_length, n_fft=n_fft)
    left = (n_fft - win_length) // 2
    n = np.arange(left, left + win_length)
    k = np.arange(n_fft // 2 + 1)[:, None]
    angle = 2.0 * math.pi * k * n[None, :] / n_fft
    w = window[left : left + win_length][None, :]
    kernels = np.concatenate([w * np.cos(angle), -w * np.sin(angle)], axis=0)
    return kernels[:, None, :].astype(np.float32)


class LogMelFrontend(nn.Module):
    """waveform (B, T) float32 at ``sample_rate`` → log-mel (B, n_mels, 1 + T // hop_length).

    No trainable parameters; the window, DFT kernels and filterbank are buffers
    (saved with the model so a checkpoint carries its exact frontend).
    """

    def __init__(self, cfg: FrontendConfig, *, use_dft: bool | None = None) -> None:
        super().__init__()
        if cfg.win_length > cfg.n_fft:
            raise ValueError(f"win_length {cfg.win_length} > n_fft {cfg.n_fft}")
        self.cfg = cfg
        self.use_dft = use_dft
        self.n_freq = cfg.n_fft // 2 + 1
        fbank = mel_filterbank(
            sample_rate=cfg.sample_rate,
            n_fft=cfg.n_fft,
            n_mels=cfg.n_mels,
            f_min=cfg.f_min,
            f_max=cfg.f_max,
        )
        window = padded_hann_window(win_length=cfg.win_length, n_fft=cfg.n_fft)
        self.register_buffer("mel_fb", torch.from_numpy(fbank), persistent=False)
        self.register_buffer(
            "window", torch.from_numpy(window.astype(np.float32)), persistent=False
        )
        kernels = dft_kernels(win_length=cfg.win_length, n_fft=cfg.n_fft)
        self.register_buffer("dft", torch.from_numpy(kernels), persistent=False)

    @property
    def n_mels(self) -> int:
        return self.cfg.n_mels

    def num_frames(self, num_samples: int) -> int:
        """Frames produced for a waveform of ``num_samples`` samples."""
        return 1 + num_samples // self.cfg.hop_length

    def power_fft(self, waveform: Tensor) -> Tensor:
        """Power spectrum (B, n_freq, frames) with ``torch.stft`` (training path)."""
        spec = torch.stft(
            waveform,
            n_fft=self.cfg.n_fft,
            hop_length=self.cfg.hop_length,
            window=self.window,
            center=True,
            pad_mode="constant",
            return_complex=True,
        )
        return spec.real.square() + spec.imag.square()

    def power_dft(self, waveform: Tensor) -> Tensor:
        """Power spectrum (B, n_freq, frames) as conv1d with DFT kernels (ONNX path)."""
        # Same frames as center=True with n_fft//2 padding: only the window taps are non-zero.
        left = self.cfg.n_fft // 2 - (self.cfg.n_fft - self.cfg.win_length) // 2
        pads = (left, self.cfg.win_length - left)
        padded = nn.functional.pad(waveform.unsqueeze(1), pads)
        spec = nn.functional.conv1d(padded, self.dft, stride=self.cfg.hop_length)
        real, imag = spec[:, : self.n_freq], spec[:, self.n_freq :]
        return real.square() + imag.square()

    def log_mel(self, waveform: Tensor) -> Tensor:
        """The features, in the dtype of ``waveform``."""
        use_dft = self.use_dft
        if use_dft is None:
            use_dft = torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()
        power = self.power_dft(waveform) if use_dft else self.power_fft(waveform)
        mel = torch.matmul(self.mel_fb, power)
        return torch.log(mel + LOG_EPS)

    def forward(self, waveform: Tensor) -> Tensor:
        device = waveform.device.type
        if torch.is_autocast_enabled(device):
            # Mel power overflows float16: the features are always computed in float32.
            with torch.autocast(device_type=device, enabled=False):
                return self.log_mel(waveform.float())
        return self.log_mel(waveform)
