"""Uploaded audio: content sniffing, header probe against the limits, decoding.

The declared ``Content-Type`` and file name are ignored; the container is
recognised from its magic bytes (RIFF/WAVE, fLaC, OggS, ID3 or an MPEG audio
frame sync), then soundfile reads the header so sample rate, channels and
duration are checked *before* the samples are decoded. Every failure is a
:class:`service.errors.ServiceError` (4xx), never an unhandled exception.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import soundfile as sf

from index.audio import AudioTooLongError, decode_audio
from service.errors import ServiceError
from tonearm.errors import AudioDecodeError

SUPPORTED = "WAV, FLAC, OGG (Vorbis/Opus) or MP3"
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


def _is_mpeg_frame(head: bytes) -> bool:
    """MPEG audio frame header: 11-bit sync, a defined version and layer, a valid bitrate index."""
    if len(head) < 3 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return False
    version, layer, bitrate = (head[1] >> 3) & 0b11, (head[1] >> 1) & 0b11, head[2] >> 4
    return version != 0b01 and layer != 0b00 and bitrate != 0b1111


def sniff(data: bytes) -> str:
    """Container name from the leading bytes; ``unsupported-audio`` for anything else."""
    if len(data) >= 12 and data[:4] in (b"RIFF", b"RF64") and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:3] == b"ID3" or _is_mpeg_frame(data[:3]):
        return "mp3"
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
        raise ServiceError("audio-decode-failed", f"the {fmt} upload is corrupt or truncated: {err}") from None


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
        wave = decode_audio(data, sample_rate=sample_rate, max_seconds=limits.max_seconds)
    except AudioTooLongError as err:
        raise ServiceError("audio-limits", str(err)) from None
    except (AudioDecodeError, sf.LibsndfileError, RuntimeError, ValueError, EOFError) as err:
        raise ServiceError("audio-decode-failed", f"the {fmt} upload cannot be decoded: {err}") from None
    return DecodedAudio(waveform=wave, format=fmt, duration_seconds=wave.shape[0] / sample_rate)
