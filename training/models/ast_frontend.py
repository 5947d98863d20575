"""``ASTFeatureExtractor``'s features in torch (issue 32): the AST training tower and its ONNX export.

``transformers.ASTFeatureExtractor`` computes a Kaldi-style filter bank (``torchaudio``'s
``kaldi.fbank`` when it loads, else the same recipe in numpy through ``audio_utils.spectrogram``).
This module computes that recipe with batched tensor operations (one strided ``conv1d`` whose
kernels fold DC removal, pre-emphasis, window and DFT together, so it runs on device in training
and traces to ONNX):

* frames of 400 samples every 160, no centre padding (Kaldi's ``snip_edges``):
  ``1 + (T − 400) // 160`` frames;
* per frame: DC offset removed, pre-emphasis 0.97 (``x[n] − 0.97 x[n−1]``, first sample
  ``x[0] · 0.03``), symmetric Hann window of 400, zero-padded to a 512-point DFT, power;
* the extractor's mel bank: Kaldi mel scale, triangular in mel space, 20 Hz to Nyquist, no norm;
  floored at float32's epsilon, natural log;
* frames zero-padded (value 0 before normalisation) or cropped to ``max_length`` (the first
  ``max_length`` frames: deterministic); a batch brings a short clip to the batch's length with a
  NaN tail (padding ``frames``, :mod:`index.audio.frontend`) and every frame touching it becomes
  such a padding frame, so the clip's features are the extractor's own;
* normalised ``(x − mean) / (2 · std)`` with the extractor's AudioSet statistics.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

FRAME, HOP, FFT = 400, 160, 512
PREEMPHASIS = 0.97
MEL_FLOOR = 1.192092955078125e-07


def ast_mel_filters(extractor: Any) -> np.ndarray:
    """The extractor's (257, num_mel_bins) bank (computed as its numpy path does)."""
    from transformers.audio_utils import mel_filter_bank

    return np.asarray(
        mel_filter_bank(
            num_frequency_bins=FFT // 2 + 1, num_mel_filters=int(extractor.num_mel_bins), min_frequency=20,
            max_frequency=int(extractor.sampling_rate) // 2, sampling_rate=int(extractor.sampling_rate),
            norm=None, mel_scale="kaldi", triangularize_in_mel_space=True,
        ),
        dtype=np.float64,
    )


class ASTWaveFrontend(nn.Module):
    """waveform (B, T) at the extractor's rate → AST ``input_values`` (B, max_length, num_mel_bins)."""

    dft: Tensor
    mel_fb: Tensor

    def __init__(self, extractor: Any) -> None:
        super().__init__()
        self.max_length = int(extractor.max_length)
        self.do_normalize = bool(extractor.do_normalize)
        self.mean, self.std = float(extractor.mean), float(extractor.std)
        # Per frame, DC removal, pre-emphasis, the window and the DFT are all linear: one
        # (2 · 257, 400) matrix, applied to every frame as a strided conv1d (ONNX-exportable).
        n = np.arange(FRAME)
        centre = np.eye(FRAME) - 1.0 / FRAME
        emphasis = np.eye(FRAME) - PREEMPHASIS * np.eye(FRAME, k=-1)
        emphasis[0, 0] = 1.0 - PREEMPHASIS
        window = 0.5 - 0.5 * np.cos(2.0 * math.pi * n / (FRAME - 1))  # symmetric Hann
        angle = 2.0 * math.pi * np.arange(FFT // 2 + 1)[:, None] * n[None, :] / FFT
        dft = np.concatenate([np.cos(angle), -np.sin(angle)], axis=0) * window[None, :]
        kernels = (dft @ emphasis @ centre)[:, None, :]
        self.register_buffer("dft", torch.from_numpy(kernels.astype(np.float32)), persistent=False)
        self.register_buffer(
            "mel_fb", torch.from_numpy(ast_mel_filters(extractor).astype(np.float32)), persistent=False
        )

    def forward(self, waveform: Tensor) -> Tensor:
        x = waveform.float()
        if x.shape[-1] < FRAME:
            x = nn.functional.pad(x, (0, FRAME - x.shape[-1]))
        spec = nn.functional.conv1d(x.unsqueeze(1), self.dft, stride=HOP).transpose(1, 2)  # (B, F, 514)
        half = spec.shape[-1] // 2
        power = spec[..., :half].square() + spec[..., half:].square()
        fbank = torch.log(torch.matmul(power, self.mel_fb).clamp_min(MEL_FLOOR))
        # A frame touching the NaN tail of a short clip (padding "frames") is a padding frame: 0
        # before the normalisation, as the extractor pads frames after its fbank.
        fbank = torch.where(torch.isnan(fbank), torch.zeros_like(fbank), fbank)
        fbank = nn.functional.pad(fbank, (0, 0, 0, self.max_length))[:, : self.max_length]
        if self.do_normalize:
            fbank = (fbank - self.mean) / (2.0 * self.std)
        return fbank


def ast_extractor(path: str | None, *, sample_rate: int, num_mel_bins: int, max_length: int) -> Any:
    """The folder's ``ASTFeatureExtractor`` (``preprocessor_config.json``) when it has one, else the
    extractor's defaults at the model's ``num_mel_bins`` / ``max_length`` and the given rate."""
    from pathlib import Path

    from transformers import ASTFeatureExtractor

    if path is not None and (Path(path).expanduser() / "preprocessor_config.json").is_file():
        return ASTFeatureExtractor.from_pretrained(path)
    return ASTFeatureExtractor(sampling_rate=sample_rate, num_mel_bins=num_mel_bins, max_length=max_length)
