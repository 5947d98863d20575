"""Uploaded audio: content sniffing, header probe against the limits, decoding.

The declared ``Content-Type`` and file name are ignored; the container is
recognised from its magic bytes (:mod:`index.audio_formats`, the one list that
``tonearm index`` uses too), then soundfile reads the header so sample rate,
channels and duration are checked *before* the samples are decoded, and the whole
stream is decoded (a truncated file is refused, not searched with what is left).
Every failure is a :class:`service.errors.ServiceError` (4xx), never an unhandled
exception, and no detail carries a Python repr.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import soundfile as sf

from index.audio import AudioTooLongError, decode_audio, libsndfile_message
from index.audio_formats import SUPPORTED, sniff_format
from index.errors import AudioDecodeError
from service.errors import ServiceError

MIN_SAMPLE_RATE = 1000


@dataclass(frozen=True)
class AudioLimits:
    max_seconds: float
    max_sample_rate: int
    max_channels: int


@dataclass(frozen=True)
class DecodedAudio:
    waveform: np.ndarray
    format: str
    duration_seconds: float


def sniff(data: bytes) -> str:
    """Container name from the leading bytes; ``unsupported-audio`` for anything else."""
    fmt = sniff_format(data[:12])
    if fmt is not None:
        return fmt
    if not data:
        raise ServiceError("unsupported-audio", "the upload is empty; send a " + SUPPORTED + " file")
    raise ServiceError(
        "unsupported-audio",
        f"the upload is not {SUPPORTED} audio (recognised by its content, not its declared type)",
    )


def _probe(data: bytes, fmt: str) -> sf._SoundFileInfo:
    try:
        return sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError, EOFError) as err:
        raise ServiceError(
            "audio-decode-failed", f"the {fmt} upload is corrupt or truncated: {libsndfile_message(err)}"
        ) from None


def check_header(info: sf._SoundFileInfo, limits: AudioLimits) -> None:
    """Sample rate, channel and duration limits from the header (duration again after decoding)."""
    rate, channels = int(info.samplerate), int(info.channels)
    if not MIN_SAMPLE_RATE <= rate <= limits.max_sample_rate:
        raise ServiceError(
            "audio-limits",
            f"sample rate {rate} Hz is outside {MIN_SAMPLE_RATE}–{limits.max_sample_rate} Hz",
        )
    if not 1 <= channels <= limits.max_channels:
        raise ServiceError("audio-limits", f"{channels} channels; at most {limits.max_channels} are accepted")
    if info.frames > 0 and info.frames / rate > limits.max_seconds:
        raise ServiceError(
            "audio-limits", f"{info.frames / rate:.1f} s of audio exceeds the limit of {limits.max_seconds:g} s"
        )


def decode_upload(data: bytes, *, sample_rate: int, limits: AudioLimits) -> DecodedAudio:
    """Sniff, probe, check limits and decode to float32 mono at ``sample_rate``."""
    fmt = sniff(data)
    check_header(_probe(data, fmt), limits)
    try:
        wave = decode_audio(data, sample_rate=sample_rate, max_seconds=limits.max_seconds, complete=True)
    except AudioTooLongError as err:
        raise ServiceError("audio-limits", str(err)) from None
    except (AudioDecodeError, sf.LibsndfileError, RuntimeError, ValueError, EOFError) as err:
        raise ServiceError("audio-decode-failed", f"the {fmt} upload cannot be decoded: {libsndfile_message(err)}") from None
    return DecodedAudio(waveform=wave, format=fmt, duration_seconds=wave.shape[0] / sample_rate)
