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
of the process then holds its estimate in the process's memory budget (``TONEARM_DECODE_MEMORY_BYTES``,
:mod:`service.memory_budget`, shared with the request bodies) while it runs, and a request's decoded audio
stays in it until the request ends: concurrent uploads are bounded by memory, not by the crowd.
Every failure is a :class:`service.errors.ServiceError` (4xx), never an unhandled
exception, and no detail carries a Python repr.
"""

from __future__ import annotations

import io
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import soundfile as sf

from index.audio.decode import (
    DECODE_BLOCK_FRAMES,
    AudioLimitError,
    AudioTooLongError,
    check_decode_header,
    decode_audio,
    decode_blocks,
    decode_estimate,
    libsndfile_message,
    resampled_length,
    stream_estimate,
)
from index.audio.formats import SUPPORTED, sniff_format
from index.errors import AudioDecodeError
from index.moments.windows import HOP_FRACTION, StreamedRecording, embed_stream, stream_embed_bytes
from service.errors import ServiceError
from service.memory_budget import RETRY_AFTER_S, MemoryBudget, UploadLease, process_budget

MIN_SAMPLE_RATE = 1000


DECODE_RETRY_AFTER_S = RETRY_AFTER_S

DecodeBudget = MemoryBudget
"""The byte semaphore decodes hold their estimate in (:class:`service.memory_budget.MemoryBudget`)."""


def decode_budget(capacity: int) -> MemoryBudget:
    """The process's budget of this capacity (one per process: every route, its bodies and decodes, and
    the item sync share it; :func:`service.memory_budget.process_budget`)."""
    return process_budget(capacity)


@dataclass(frozen=True)
class AudioLimits:
    max_seconds: float
    max_sample_rate: int
    max_channels: int
    max_decode_samples: int | None = None
    max_decoded_bytes: int | None = None
    budget: MemoryBudget | None = None
    wait_s: float = 10.0
    stream_after_seconds: float | None = None
    """Audio longer than this (by its header; or of unknown length) is decoded by blocks and never held whole
    (item writes: :func:`item_limits_of`); None: every upload is decoded whole (search uploads)."""

    def streams(self, frames: int, rate: int) -> bool:
        """Whether audio of ``frames`` at ``rate`` (from its header; ≤ 0: unknown) is decoded by blocks."""
        if self.stream_after_seconds is None:
            return False
        return frames <= 0 or frames / max(rate, 1) > self.stream_after_seconds


def limits_of(settings: Any) -> AudioLimits:
    """The search uploads' limits of ``settings`` (service.settings.Settings), with the process's decode budget."""
    return AudioLimits(
        max_seconds=settings.max_audio_seconds, max_sample_rate=settings.max_sample_rate,
        max_channels=settings.max_channels, max_decode_samples=settings.max_decode_samples,
        max_decoded_bytes=settings.max_decoded_bytes, budget=decode_budget(settings.decode_memory_bytes),
        wait_s=settings.decode_wait_s,
    )


def item_limits_of(settings: Any) -> AudioLimits:
    """The item writes' limits (``POST /v1/items``, ``items:batch``, the item sync): the longer duration and
    decode-samples limits of items, the same rate and channel limits; audio longer than a search upload may be
    is decoded and embedded by blocks (``stream_after_seconds``), so its length costs time, not memory."""
    return replace(limits_of(settings), max_seconds=settings.max_item_audio_seconds,
                   max_decode_samples=settings.max_item_decode_samples,
                   stream_after_seconds=min(settings.max_audio_seconds, settings.max_item_audio_seconds))


def _setting(limits: AudioLimits) -> str:
    return "TONEARM_MAX_ITEM_AUDIO_SECONDS" if limits.stream_after_seconds is not None else "TONEARM_MAX_AUDIO_SECONDS"


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
            "audio-limits", f"{info.frames / rate:.1f} s of audio exceeds the limit of {limits.max_seconds:g} s "
            f"({_setting(limits)})"
        )
    streamed = limits.streams(int(info.frames), rate)
    try:
        check_decode_header("the upload", int(info.frames), channels, rate, sample_rate,
                            max_samples=limits.max_decode_samples,
                            max_bytes=None if streamed else limits.max_decoded_bytes)
    except AudioLimitError as err:
        raise ServiceError("audio-limits", _named(err, limits)) from None
    if streamed and limits.max_decoded_bytes is not None:
        cost = stream_estimate(channels, rate, sample_rate)
        if cost > limits.max_decoded_bytes:
            raise ServiceError("audio-limits", f"decoding needs ~{cost} bytes; the limit is {limits.max_decoded_bytes}")


def _named(err: AudioLimitError, limits: AudioLimits) -> str:
    """A decoder's limit message, with the setting named for the duration limit."""
    return f"{err} ({_setting(limits)})" if isinstance(err, AudioTooLongError) else str(err)


def check_upload_header(data: bytes, limits: AudioLimits, sample_rate: int = 16000) -> None:
    """What :func:`decode_upload` checks before it decodes — container, header, limits — without
    decoding (a stored item whose embedding is already known is judged by today's limits this way)."""
    check_header(_probe(data, sniff(data)), limits, sample_rate)


def _estimate(info: sf._SoundFileInfo, limits: AudioLimits, sample_rate: int) -> int:
    """What the decode will hold in the budget: its estimate at the header's length, or at the longest
    length the limits allow when the header does not know it."""
    rate = int(info.samplerate)
    if limits.streams(int(info.frames), rate):
        return stream_estimate(int(info.channels), rate, sample_rate)
    frames = int(info.frames) if info.frames > 0 else int(limits.max_seconds * rate)
    return decode_estimate(frames, int(info.channels), rate, sample_rate)


@dataclass(frozen=True)
class ProbedUpload:
    """An upload whose header passed the limits: its container and what decoding it will hold;
    ``streamed``: decoded by blocks, never held whole (:attr:`AudioLimits.stream_after_seconds`)."""
    format: str
    estimate: int
    streamed: bool = False
    channels: int = 1
    rate: int = 0


def probe_upload(data: bytes, *, sample_rate: int, limits: AudioLimits) -> ProbedUpload:
    """Sniff, probe and check the limits from the header: cheap, before any decoding."""
    fmt = sniff(data)
    info = _probe(data, fmt)
    check_header(info, limits, sample_rate)
    return ProbedUpload(fmt, _estimate(info, limits, sample_rate), limits.streams(int(info.frames), int(info.samplerate)),
                        int(info.channels), int(info.samplerate))


def _blocks(data: bytes, probed: ProbedUpload, sample_rate: int, limits: AudioLimits) -> Iterator[np.ndarray]:
    """A streamed upload's blocks (:func:`index.audio.decode.decode_blocks`), failures as problem documents."""
    fmt = probed.format
    try:
        yield from decode_blocks(data, sample_rate=sample_rate, max_seconds=limits.max_seconds, complete=True,
                                 max_samples=limits.max_decode_samples)
    except AudioLimitError as err:
        raise ServiceError("audio-limits", _named(err, limits)) from None
    except (AudioDecodeError, sf.LibsndfileError, RuntimeError, ValueError, EOFError) as err:
        raise ServiceError("audio-decode-failed", f"the {fmt} upload cannot be decoded: {libsndfile_message(err)}") from None


NO_WAVEFORM = np.zeros(0, np.float32)
"""The waveform of a streamed upload's :class:`DecodedAudio`: it was never held whole."""


def decode_probed(data: bytes, probed: ProbedUpload, *, sample_rate: int, limits: AudioLimits) -> DecodedAudio:
    """Decode a probed upload to float32 mono at ``sample_rate`` (its budget is the caller's to hold). A
    streamed one is decoded by blocks to check it and measure it (every sample, as a whole decode would),
    and its waveform is :data:`NO_WAVEFORM`: it is embedded from its bytes by blocks (:func:`embed_upload`)."""
    fmt = probed.format
    if probed.streamed:
        samples = sum(len(block) for block in _blocks(data, probed, sample_rate, limits))
        if samples == 0:
            raise ServiceError("audio-decode-failed", f"the {fmt} upload is too short to resample to {sample_rate} Hz")
        return DecodedAudio(waveform=NO_WAVEFORM, format=fmt, duration_seconds=samples / sample_rate)
    try:
        wave = decode_audio(data, sample_rate=sample_rate, max_seconds=limits.max_seconds, complete=True,
                            max_samples=limits.max_decode_samples, max_bytes=limits.max_decoded_bytes)
    except AudioLimitError as err:
        raise ServiceError("audio-limits", _named(err, limits)) from None
    except (AudioDecodeError, sf.LibsndfileError, RuntimeError, ValueError, EOFError) as err:
        raise ServiceError("audio-decode-failed", f"the {fmt} upload cannot be decoded: {libsndfile_message(err)}") from None
    return DecodedAudio(waveform=wave, format=fmt, duration_seconds=wave.shape[0] / sample_rate)


def embed_bytes(probed: ProbedUpload, sample_rate: int, window_samples: int) -> int:
    """What :func:`embed_upload` holds at once for a streamed upload: the decoder's block and the windows
    it keeps (:func:`index.moments.windows.stream_embed_bytes`), whatever the recording's length."""
    hop = max(1, round(window_samples * HOP_FRACTION))
    block = resampled_length(DECODE_BLOCK_FRAMES, max(1, probed.rate), sample_rate) + 1
    return probed.estimate + stream_embed_bytes(window_samples, hop, block)


def embed_upload(data: bytes, bundle: Any, *, limits: AudioLimits) -> StreamedRecording | None:
    """A long upload (``probed.streamed``) decoded and embedded by blocks with ``bundle``'s audio encoder,
    holding :func:`embed_bytes` of the memory budget while it runs: its clip vector (what the encoder gives
    the whole waveform: the mean of its windows) and its moment windows. None for audio decoded whole (the
    caller decodes and encodes it as before: same vectors, batched with other items)."""
    rate, window = int(bundle.sample_rate), int(bundle.clip_samples)
    probed = probe_upload(data, sample_rate=rate, limits=limits)
    if not probed.streamed:
        return None
    budget = limits.budget or MemoryBudget(1 << 62)
    with budget.hold(embed_bytes(probed, rate, window), limits.wait_s):
        try:
            return embed_stream(_blocks(data, probed, rate, limits), sample_rate=rate, window_samples=window,
                                hop_samples=max(1, round(window * HOP_FRACTION)), encode=bundle.encode_audio)
        except ValueError as err:  # no samples at the model's rate
            raise ServiceError("audio-decode-failed", f"the {probed.format} upload: {err}") from None


def decode_upload(data: bytes, *, sample_rate: int, limits: AudioLimits) -> DecodedAudio:
    """Sniff, probe, check limits and decode to float32 mono at ``sample_rate``, holding the decode's
    estimate in the budget while it runs (this thread waits for room: the item sync's decodes)."""
    probed = probe_upload(data, sample_rate=sample_rate, limits=limits)
    budget = limits.budget or MemoryBudget(1 << 62)
    with budget.hold(probed.estimate, limits.wait_s):
        return decode_probed(data, probed, sample_rate=sample_rate, limits=limits)


async def decode_for_request(
    data: bytes, *, sample_rate: int, limits: AudioLimits, lease: UploadLease,
    run: Callable[..., Awaitable[Any]], keep: bool = True,
) -> DecodedAudio:
    """A request's decode: probe in a thread (``run``: the pool), wait for room for the decode's estimate
    on the event loop (never in a pool thread the requests holding the budget need), decode in a thread;
    the bytes of the decoded audio then stay held by ``lease`` until the request ends (``keep=False``:
    the caller drops the waveform, and they go back at once)."""
    probed: ProbedUpload = await run(_probe_call, data, sample_rate, limits)
    budget = lease.budget
    taken = await budget.take_async(probed.estimate, limits.wait_s, body=False)
    kept = 0
    try:
        audio: DecodedAudio = await run(_decode_call, data, probed, sample_rate, limits)
        if keep:
            kept = min(taken, int(audio.waveform.nbytes))
    finally:  # an error, or a cancelled request: the decode's bytes go back too
        budget.give(taken - kept)
    lease.keep(kept)
    return audio


def _probe_call(data: bytes, sample_rate: int, limits: AudioLimits) -> ProbedUpload:
    return probe_upload(data, sample_rate=sample_rate, limits=limits)


def _decode_call(data: bytes, probed: ProbedUpload, sample_rate: int, limits: AudioLimits) -> DecodedAudio:
    return decode_probed(data, probed, sample_rate=sample_rate, limits=limits)
