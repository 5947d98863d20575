"""CLAP's log-mel in torch (SPEC §11): ``ClapFeatureExtractor``'s spectrogram, exportable to ONNX.

``transformers.ClapFeatureExtractor`` computes its features in numpy
(``audio_utils.spectrogram``), so they cannot live inside an ONNX graph. This
module computes the same thing with operators every ONNX runtime has, from the
extractor's own parameters and filter bank:

* frames: ``center=True`` with **reflect** padding of ``n_fft // 2`` on both sides,
  frame ``t`` centred on sample ``t · hop`` → ``1 + T // hop`` frames (1001 for
  10 s at 48 kHz, hop 480);
* window: periodic Hann of ``n_fft`` samples (``window_function(n_fft, "hann")``);
* power spectrum ``|DFT|²`` as a ``conv1d`` with fixed cos/sin kernels
  (:func:`training.models.frontend.dft_kernels`, the same DFT path as our own frontend's
  ONNX export);
* mel: the extractor's filter bank — ``mel_filters_slaney`` (librosa's Slaney scale and
  area norm) for ``truncation="rand_trunc"``, ``mel_filters`` (HTK, no norm) for
  ``"fusion"`` — floored at ``mel_floor = 1e-10``;
* log: ``10 · log10(max(mel, 1e-10))`` (``power_to_db`` with reference 1, no ``top_db``).

Output (B, frames, n_mels) in dB: the ``input_features`` layout of one channel of the
extractor (``(B, 1, frames, n_mels)`` after ``unsqueeze(1)``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from training.models.frontend import dft_kernels

MEL_FLOOR = 1e-10
"""``spectrogram(mel_floor=...)`` and ``power_to_db(min_value=...)`` of the extractor."""


class ClapMelFrontend(nn.Module):
    """waveform (B, T) float32 → CLAP log-mel in dB (B, frames, n_mels), ``frames`` fixed.

    ``mel_filters`` is the extractor's (n_fft // 2 + 1, n_mels) matrix. Inputs whose frame
    count is not ``frames`` are right-padded with the silence value (−100 dB) or cropped;
    the bundle always feeds exactly ``max_length_s`` of audio, so this only guards other callers.
    """

    def __init__(self, *, mel_filters: np.ndarray, n_fft: int, hop_length: int, frames: int) -> None:
        super().__init__()
        n_freq = n_fft // 2 + 1
        if mel_filters.shape[0] != n_freq:
            raise ValueError(f"mel filters have {mel_filters.shape[0]} rows, expected n_fft // 2 + 1 = {n_freq}")
        self.n_fft, self.hop_length, self.frames, self.n_freq = n_fft, hop_length, frames, n_freq
        fbank = np.ascontiguousarray(mel_filters.T, dtype=np.float32)
        self.register_buffer("mel_fb", torch.from_numpy(fbank), persistent=False)
        kernels = dft_kernels(win_length=n_fft, n_fft=n_fft)
        self.register_buffer("dft", torch.from_numpy(kernels), persistent=False)

    def forward(self, waveform: Tensor) -> Tensor:
        pad = self.n_fft // 2
        padded = nn.functional.pad(waveform.float().unsqueeze(1), (pad, pad), mode="reflect")
        spec = nn.functional.conv1d(padded, self.dft, stride=self.hop_length)
        power = spec[:, : self.n_freq].square() + spec[:, self.n_freq :].square()
        mel = torch.matmul(self.mel_fb, power).clamp_min(MEL_FLOOR)
        db = 10.0 * torch.log10(mel)
        silence = 10.0 * float(np.log10(MEL_FLOOR))
        db = nn.functional.pad(db, (0, self.frames), value=silence)[..., : self.frames]
        return db.transpose(1, 2)
