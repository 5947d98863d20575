"""The windows of a catalogue's long recordings written into a bundle being staged (`tonearm export`), and the
bundle's held-out moment report.

The windows themselves are embedded by the catalogue pass, from the decode of each file's clip vector
(:mod:`index.catalogue.pass_windows`); only the held-out recordings are decoded here, for the report. Kept
apart from :mod:`index.moments.windows` so that the loader (which opens a bundle's windows) and this module
(which runs the bundle's encoder) do not import each other."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from index.bundle.format import AudioFrontendInfo, MomentsInfo
from index.bundle.tokenizer import TextTokenizer
from index.moments.evaluate import evaluate_moments
from index.moments.windows import write_bundle_windows
from index.runtime.loader import AUDIO_INPUTS, TEXT_INPUTS, OnnxEncoder, encode_clips, encode_texts


@dataclass(frozen=True)
class StagedEncoders:
    """The staged bundle's encoders, as :func:`index.moments.evaluate.evaluate_moments` calls a bundle."""

    sample_rate: int
    clip_samples: int
    encode_audio: Callable[[Sequence[np.ndarray]], np.ndarray]
    encode_text: Callable[[Sequence[str]], np.ndarray]


def export_windows(
    staging: Path, windows: Sequence[tuple[int, np.ndarray, np.ndarray]], *, encoder_file: str, sample_rate: int,
    clip_samples: int, embed_dim: int, frontend: AudioFrontendInfo | None, providers: Sequence[str],
    heldout: Sequence[Any] = (), text_files: tuple[str, str] | None = None, languages: Sequence[str] = (),
) -> MomentsInfo | None:
    """Write the catalogue pass's ``windows`` — ``(audio index row, spans, vectors)`` of each long recording
    (:func:`index.catalogue.pass_windows.bundle_windows`) — into ``staging``; None when there is none.

    ``heldout``: the held-out split's records with ``moments``; with the staged ``text_files``
    (text encoder, tokenizer) their moment report (:func:`index.moments.evaluate.evaluate_moments`,
    per language of ``languages``; each recording decoded here and embedded by the staged audio encoder) goes
    into the manifest's ``moments.heldout``."""
    if not windows:
        return None
    info = write_bundle_windows(staging, windows, sample_rate=sample_rate, window_samples=clip_samples)
    if not heldout or text_files is None:
        return info
    encoder = OnnxEncoder.load(staging / encoder_file, inputs=AUDIO_INPUTS, embed_dim=embed_dim,
                               providers=list(providers), threads=None)

    def encode(waves: Sequence[np.ndarray]) -> np.ndarray:
        return encode_clips(encoder, waves, clip_samples=clip_samples, embed_dim=embed_dim, frontend=frontend)
    text_encoder = OnnxEncoder.load(staging / text_files[0], inputs=TEXT_INPUTS, embed_dim=embed_dim,
                                    providers=list(providers), threads=None)
    tokenizer = TextTokenizer.from_file(staging / text_files[1])

    def encode_text(texts: Sequence[str]) -> np.ndarray:
        return encode_texts(text_encoder, tokenizer, texts, embed_dim=embed_dim)

    staged = StagedEncoders(sample_rate, clip_samples, encode, encode_text)
    report = evaluate_moments(staged, heldout, languages=languages)
    return info.model_copy(update={"heldout": report})
