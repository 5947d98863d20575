"""The windows of a catalogue's long recordings, embedded by a bundle being staged (`tonearm export`).

Kept apart from :mod:`index.moment_index` so that the loader (which opens a bundle's windows) and
this module (which runs the bundle's encoder) do not import each other."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from index.audio import decode_audio
from index.bundle import AudioFrontendInfo, MomentsInfo
from index.loader import AUDIO_INPUTS, OnnxEncoder, encode_clips
from index.moment_index import index_recordings, write_bundle_windows


def export_windows(
    staging: Path, paths: Sequence[Path], *, encoder_file: str, sample_rate: int, clip_samples: int, embed_dim: int,
    frontend: AudioFrontendInfo | None, providers: Sequence[str],
) -> MomentsInfo | None:
    """Windows of the long recordings among a catalogue's ``paths`` (row i = paths[i]), embedded by the
    bundle's staged audio encoder and written into ``staging``; None when there is none."""
    encoder = OnnxEncoder.load(staging / encoder_file, inputs=AUDIO_INPUTS, embed_dim=embed_dim,
                               providers=list(providers), threads=None)

    def encode(waves: Sequence[np.ndarray]) -> np.ndarray:
        return encode_clips(encoder, waves, clip_samples=clip_samples, embed_dim=embed_dim, frontend=frontend)

    def decode(path: Path, rate: int) -> np.ndarray:
        return decode_audio(path, sample_rate=rate)

    windows = index_recordings(paths, sample_rate=sample_rate, window_samples=clip_samples, decode=decode,
                               encode=encode)
    if not windows:
        return None
    return write_bundle_windows(staging, windows, sample_rate=sample_rate, window_samples=clip_samples)
