"""Uploaded audio: content sniffing, header probe against the limits, decoding.

The declared ``Content-Type`` and file name are ignored; the container is
recognised from its magic bytes (:mod:`index.audio.formats`, the one list that
``tonearm index`` uses too), then soundfile reads the header so sample rate,
channels and duration are checked *before* the samples are decoded, and the whole
stream is decoded (a truncated file is refused, not searched with what is left).

Decoding is bounded before it starts (docs/service.md, "Limits"): the header's frames × channels
against ``TONEARM_MAX_DECODE_SAMPLES`` (the CPU a decode costs) and
:func:`index.audio.decode.decode_estimate` against ``TONEARM_MAX_DECODED_BYTES`` (its memory: one block of
every channel and the mono output; the decoder never holds every channel of the clip). Every decode
of the process then holds its estimate in one :class:`DecodeBudget` (``TONEARM_DECODE_MEMORY_BYTES``)
while it runs: concurrent decodes are bounded by memory, not only by the thread pool.
Every failure is a :class:`service.errors.ServiceError` (4xx), never an unhandled
exception, and no detail carries a Python repr.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile as sf

from index.audio.decode import (
    AudioLimitError,
    check_decode_header,
    decode_audio,
    decode_estimate,
    libsndfile_message,
)
from index.audio.formats import SUPPORTED, sniff_format
from index.errors import AudioDecodeError
from service.errors import ServiceError

MIN_SAMPLE_RATE = 1000


DECODE_RETRY_AFTER_S = 1


class DecodeBudget:
    """A byte semaphore: decodes hold their estimated memory while they run, and wait while the
    decodes already running hold too much of ``capacity`` (one larger than the whole budget runs alone)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int, timeout: float) -> Iterator[None]:
        nbytes = max(0, min(nbytes, self.capacity))
        with self._cond:
            if not self._cond.wait_for(lambda: self.used + nbytes <= self.capacity, timeout):
                raise ServiceError(
                    "overloaded", f"the decodes running hold the memory budget of {self.capacity} bytes; "
                    f"retry after {DECODE_RETRY_AFTER_S} s", retry_after=DECODE_RETRY_AFTER_S,
                )
            self.used += nbytes
            self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            with self._cond:
                self.used -= nbytes
                self._cond.notify_all()


_BUDGETS: dict[int, DecodeBudget] = {}
_BUDGETS_LOCK = threading.Lock()


def decode_budget(capacity: int) -> DecodeBudget:
    """The process's budget of this capacity (one per process: every route and the item sync share it)."""
    with _BUDGETS_LOCK:
        return _BUDGETS.setdefault(capacity, DecodeBudget(capacity))


@dataclass(frozen=True)
class AudioLimits:
    max_seconds: float
    max_sample_rate: int
    max_channels: int
    max_decode_samples: int | None = None
    max_decoded_bytes: int | None = None
    budget: DecodeBudget | None = None
    wait_s: float = 10.0


def limits_of(settings: Any) -> AudioLimits:
    """The upload limits of ``settings`` (service.settings.Settings), with the process's decode budget."""
    return AudioLimits(
        max_seconds=settings.max_audio_seconds, max_sample_rate=settings.max_sample_rate,
        max_channels=settings.max_channels, max_decode_samples=settings.max_decode_samples,
        max_decoded_bytes=settings.max_decoded_bytes, budget=decode_budget(settings.decode_memory_bytes),
        wait_s=settings.decode_wait_s,
    )


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


def check_header(info: sf._SoundFileInfo, limits: AudioLimits, sample_rate: int = 16000) -> None:
    """Sample rate, channel, duration and decoding-cost limits from the header (the decoder counts
    duration and samples again as it goes: a header may lie)."""
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
    try:
        check_decode_header("the upload", int(info.frames), channels, rate, sample_rate,
                            max_samples=limits.max_decode_samples, max_bytes=limits.max_decoded_bytes)
    except AudioLimitError as err:
        raise ServiceError("audio-limits", str(err)) from None


def _estimate(info: sf._SoundFileInfo, limits: AudioLimits, sample_rate: int) -> int:
    """What the decode will hold in the budget: its estimate at the header's length, or at the longest
    length the limits allow when the header does not know it."""
    rate = int(info.samplerate)
    frames = int(info.frames) if info.frames > 0 else int(limits.max_seconds * rate)
    return decode_estimate(frames, int(info.channels), rate, sample_rate)


def decode_upload(data: bytes, *, sample_rate: int, limits: AudioLimits) -> DecodedAudio:
    """Sniff, probe, check limits and decode to float32 mono at ``sample_rate``."""
    fmt = sniff(data)
    info = _probe(data, fmt)
    check_header(info, limits, sample_rate)
    budget = limits.budget or DecodeBudget(1 << 62)
    try:
        with budget.hold(_estimate(info, limits, sample_rate), limits.wait_s):
            wave = decode_audio(data, sample_rate=sample_rate, max_seconds=limits.max_seconds, complete=True,
                                max_samples=limits.max_decode_samples, max_bytes=limits.max_decoded_bytes)
    except AudioLimitError as err:
        raise ServiceError("audio-limits", str(err)) from None
    except (AudioDecodeError, sf.LibsndfileError, RuntimeError, ValueError, EOFError) as err:
        raise ServiceError("audio-decode-failed", f"the {fmt} upload cannot be decoded: {libsndfile_message(err)}") from None
    return DecodedAudio(waveform=wave, format=fmt, duration_seconds=wave.shape[0] / sample_rate)
