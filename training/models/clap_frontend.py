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

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from training.config import ConfigError
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


class ClapWaveFrontend(nn.Module):
    """waveform (B, T) → CLAP ``input_features`` (B, 1, frames, n_mels), as ``ClapFeatureExtractor``
    with ``truncation="rand_trunc"`` computes them, in torch (batched, on device, traceable).

    Clips shorter than ``clip_samples`` are padded with the extractor's ``padding``; longer ones
    are cut to one window of ``clip_samples`` — a random one in training (the extractor's
    ``rand_trunc``), the first one in eval (deterministic). The frames (1 + clip_samples // hop,
    1001 at 10 s) go to the audio model unchanged: HTS-AT stretches them to its
    ``spec_size · freq_ratio`` frames by bicubic interpolation itself, exactly as for the
    extractor's output. The training tower and ``export --pretrained`` both run this module.
    """

    def __init__(self, extractor: Any) -> None:
        super().__init__()
        self.clip_samples = int(extractor.nb_max_samples)
        self.padding = str(extractor.padding)
        self.truncation = str(extractor.truncation)
        if self.truncation != "rand_trunc":  # check_clap_settings refuses it first, in one line
            raise ValueError(f"ClapWaveFrontend computes truncation='rand_trunc' features, not {self.truncation!r}")
        hop = int(extractor.hop_length)
        self.mel = ClapMelFrontend(
            mel_filters=extractor.mel_filters_slaney, n_fft=int(extractor.fft_window_size),
            hop_length=hop, frames=1 + self.clip_samples // hop,
        )

    def forward(self, waveform: Tensor) -> Tensor:
        n = self.clip_samples
        if self.training and waveform.shape[-1] > n:  # rand_trunc: one random window
            start = int(torch.randint(0, waveform.shape[-1] - n + 1, ()).item())
            waveform = waveform[:, start : start + n]
        return self.mel(self.fit(waveform)).unsqueeze(1)

    def fit(self, waveform: Tensor) -> Tensor:
        """(B, T) → (B, clip_samples): the extractor's padding, or the first window of longer
        inputs — as one gather and mask, so a traced (ONNX) graph keeps it for any T."""
        n = self.clip_samples
        length = torch._shape_as_tensor(waveform)[-1].to(waveform.device)
        positions = torch.arange(n, device=waveform.device)
        gathered = waveform[:, positions % length]
        if self.padding == "repeatpad":  # ⌊n / T⌋ whole copies (at least one), then zeros
            valid = positions < torch.clamp(n // length, min=1) * length
        elif self.padding == "repeat":
            valid = torch.ones_like(positions, dtype=torch.bool)
        else:  # pad: zeros after the clip
            valid = positions < length
        return gathered * valid.to(gathered.dtype)


def check_clap_settings(extractor: Any, audio_config: Any, *, folder: Any, key: str) -> None:
    """The refusals ``tonearm train`` (``hf_clap``) and ``export --pretrained`` share, in one line each
    (issue 41): a fused checkpoint (``enable_fusion``), and an extractor whose ``truncation`` is not
    ``rand_trunc`` (the only setting whose one-channel features an unfused HTS-AT takes; ``fusion``
    gives four channels). `folder` names the model folder, `key` the option or config key."""
    if audio_config.enable_fusion:
        raise ConfigError(
            f"{key}: {folder} is a fused CLAP (enable_fusion=true); its features depend on random crops and on "
            "the batch, so neither a bundle nor a fine-tune's step 0 reproduces them — use an unfused "
            "checkpoint (e.g. laion/clap-htsat-unfused)"
        )
    truncation = str(getattr(extractor, "truncation", "rand_trunc"))
    if truncation != "rand_trunc":
        raise ConfigError(
            f"{key}: {folder}/preprocessor_config.json has truncation={truncation!r}, but this unfused model only "
            "runs on one-channel features (truncation='rand_trunc'; 'fusion' makes get_audio_features fail)"
        )


def clap_extractor(path: str | None, *, sample_rate: int, n_fft: int, hop_length: int, n_mels: int,
                   f_min: float, f_max: float, max_frames: int) -> Any:
    """The folder's ``ClapFeatureExtractor`` (``preprocessor_config.json``) when it has one, else
    one at the given settings with laion/clap-htsat-unfused's ``rand_trunc`` / ``repeatpad`` and
    ``max_length_s`` = 10 s, or the whole seconds that fit when the model takes fewer frames
    (``max_frames`` = ``spec_size · freq_ratio``)."""
    from pathlib import Path

    from transformers import ClapFeatureExtractor

    if path is not None and (Path(path).expanduser() / "preprocessor_config.json").is_file():
        return ClapFeatureExtractor.from_pretrained(path)
    return ClapFeatureExtractor(
        feature_size=n_mels, sampling_rate=sample_rate, hop_length=hop_length, fft_window_size=n_fft,
        frequency_min=f_min, frequency_max=f_max, truncation="rand_trunc", padding="repeatpad",
        max_length_s=max(1, min(10, (max_frames - 1) * hop_length // sample_rate)),
    )
