"""Audio decoding and length fitting shared by training, export and the service (docs/corpus.md).

numpy only (no torch): soundfile decodes WAV/FLAC/OGG/MP3 (whatever the bundled
libsndfile supports), channels are averaged to mono and soxr resamples to the
model's rate. :func:`fit_length` and :func:`eval_chunks` turn a waveform of any
length into the fixed-length windows the encoders see:

* training: a random crop of ``n`` samples (zero-padded at the end when shorter);
* evaluation ``center``: the middle ``n`` samples;
* evaluation ``chunk``: non-overlapping windows of ``n`` samples, the last one
  right-aligned to the end of the clip; the clip embedding is the L2-normalized
  mean of the window embeddings (the PaSST/ATST setup of the correspondence paper).
"""

from __future__ import annotations

import io
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, TypedDict, TypeVar

import numpy as np
import soundfile as sf
import soxr

from index.audio.formats import missing_bytes, ogg_cut_short
from index.audio.frontend import Padding, pad_short_clip
from index.errors import AudioDecodeError

_T = TypeVar("_T")

CropMode = Literal["center", "random", "start"]


class AudioLimitError(AudioDecodeError):
    """Audio past one of the caller's decoding limits (the service answers 422 ``audio-limits``)."""


class AudioTooLongError(AudioLimitError):
    """Audio longer than the caller's ``max_seconds`` limit."""


class AudioTooLargeError(AudioLimitError):
    """Audio whose decoding would pass the caller's ``max_samples`` or ``max_bytes`` limit."""


class AudioRateError(AudioLimitError):
    """Audio whose sample rate is below the caller's ``min_sample_rate`` floor."""


MIN_SAMPLE_RATE = 1000
"""The lowest source rate decoded where a floor is asked for (every catalogue pass; the service's uploads
apply the same floor): resampling turns each frame of a file declaring a few hertz into thousands of
samples (2 Hz → 48 kHz: 24,000), so a 60-KB WAV would decode to GiBs."""
CATALOGUE_MAX_DECODE_SAMPLES = 4 * 3600 * 48_000 * 2
"""Default most samples (frames × channels) one file of a catalogue pass may decode: 4 h of 48-kHz stereo
(the CPU a decode costs; `--max-decode-samples`)."""
CATALOGUE_MAX_DECODED_BYTES = 2 << 30
"""Default most bytes one file of a catalogue pass may hold while decoding (:func:`decode_estimate`: about
twice its output): 2 GiB, ~1.5 h of audio at 48 kHz, ~4.6 h at 16 kHz (`--max-decoded-bytes`)."""


class DecodeLimitArgs(TypedDict):
    """:class:`DecodeLimits` as keyword arguments of :func:`decode_audio` and :func:`decode_window`."""

    min_sample_rate: int | None
    max_samples: int | None
    max_bytes: int | None


@dataclass(frozen=True)
class DecodeLimits:
    """What decoding one file of a catalogue pass may cost (docs/bundle.md, "Decode limits"): its source rate
    at least ``min_sample_rate``, at most ``max_samples`` frames × channels and :func:`decode_estimate` at most
    ``max_bytes``; None lifts a limit. Checked from the header before decoding and again while decoding
    (a header may lie); a file past one is skipped by the pass with the reason."""

    min_sample_rate: int | None = MIN_SAMPLE_RATE
    max_samples: int | None = CATALOGUE_MAX_DECODE_SAMPLES
    max_bytes: int | None = CATALOGUE_MAX_DECODED_BYTES

    def kwargs(self) -> DecodeLimitArgs:
        """As :func:`decode_audio`'s (and :func:`decode_window`'s) keyword arguments."""
        return {"min_sample_rate": self.min_sample_rate, "max_samples": self.max_samples,
                "max_bytes": self.max_bytes}

    def describe(self) -> dict[str, int | None]:
        return {"min_sample_rate": self.min_sample_rate, "max_decode_samples": self.max_samples,
                "max_decoded_bytes": self.max_bytes}

    def estimate(self, source: Path | str, sample_rate: int) -> int:
        """The bytes decoding ``source`` to ``sample_rate`` may hold under these limits, from its header alone:
        :func:`decode_estimate`, or ``max_bytes`` when the header does not know its length (the decoder stops
        there), or one block when the header alone refuses it or cannot be read (the decode fails at once)."""
        refused = DECODE_BLOCK_FRAMES * 8 + RESAMPLER_BYTES
        try:
            info = sf.info(str(source))
            frames, channels, rate = int(info.frames), int(info.channels), int(info.samplerate)
        except Exception:  # noqa: BLE001 - not readable by libsndfile: the decoder says why, at once
            return refused
        if rate < 1 or (self.min_sample_rate is not None and rate < self.min_sample_rate):
            return refused
        if frames <= 0:
            return self.max_bytes if self.max_bytes is not None else decode_estimate(0, channels, rate, sample_rate)
        cost = decode_estimate(frames, channels, rate, sample_rate)
        over = ((self.max_samples is not None and frames * channels > self.max_samples)
                or (self.max_bytes is not None and cost > self.max_bytes))
        return refused if over else cost


OBJECT_REPR = re.compile(r"Error opening <[^<>]*? at 0x[0-9a-fA-F]+>: |<[^<>]*? object at 0x[0-9a-fA-F]+>")
RESAMPLE_MARGIN_SECONDS = 0.05
"""Source audio read beyond each side of a window (:func:`decode_window`): soxr HQ's filter
reaches ~10 ms; 50 ms makes the window's samples those of the whole clip's resampling."""
DECODE_BLOCK_FRAMES = 1 << 16
"""Frames decoded at a time (:func:`decode_audio`): one float32 block of every channel is the most of
the source that is ever in memory (8 channels: 2 MiB)."""
RESAMPLER_BYTES = 1 << 20
"""What soxr's streaming resampler (HQ) holds besides its output, rounded up (:func:`decode_estimate`)."""
MPEG_FRAME_SAMPLES = 1152
"""Samples per MPEG-1 Layer III frame: how far an MP3's decoded length may fall short of its
Xing/Info count (mpg123 drops a last partial frame) before it counts as truncated."""


def libsndfile_message(err: Exception) -> str:
    """libsndfile's message without the Python repr of the file object it was given."""
    return OBJECT_REPR.sub("", str(err)).strip()


def _describe(source: Path | str | bytes) -> str:
    if isinstance(source, bytes | bytearray):
        return f"uploaded audio ({len(source)} bytes)"
    return str(source)


def _open(source: Path | str | bytes) -> sf.SoundFile:
    """Open ``source`` with soundfile, turning every failure into :class:`AudioDecodeError`."""
    name = _describe(source)
    if isinstance(source, bytes | bytearray):
        if not source:
            raise AudioDecodeError(f"{name}: empty input, not audio")
        handle: io.BytesIO | str = io.BytesIO(bytes(source))
    else:
        path = Path(source)
        if not path.exists():
            raise AudioDecodeError(f"{name}: audio file not found")
        if not path.is_file():
            raise AudioDecodeError(f"{name}: not a regular file")
        if path.stat().st_size == 0:
            raise AudioDecodeError(f"{name}: empty file, not audio")
        handle = str(path)
    try:
        return sf.SoundFile(handle)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as err:
        raise AudioDecodeError(
            f"{name}: not a supported audio format or corrupt (WAV, FLAC, OGG, MP3 are read): {libsndfile_message(err)}"
        ) from None


def _check_bytes(source: Path | str | bytes, check: Callable[[BinaryIO, int], _T]) -> _T:
    """``check(handle, size)`` over the bytes of ``source`` (in memory or a file)."""
    if isinstance(source, bytes | bytearray):
        return check(io.BytesIO(bytes(source)), len(source))
    with Path(source).open("rb") as handle:
        return check(handle, Path(source).stat().st_size)


def _check_complete(source: Path | str | bytes, container: str, declared: int, decoded: int) -> None:
    """Refuse a stream cut short: a WAV whose data chunk runs past the end, an Ogg file whose pages
    stop before an end-of-stream page, or fewer samples decoded than the header declares (FLAC
    STREAMINFO, MP3 Xing/Info; index.audio.formats)."""
    name = _describe(source)
    if container == "WAV":
        short = _check_bytes(source, missing_bytes)
        if short:
            raise AudioDecodeError(f"{name}: truncated WAV: its data chunk lacks the last {short} bytes")
    if container == "OGG":  # Ogg declares no length: the pages must chain to an end-of-stream page
        why = _check_bytes(source, ogg_cut_short)
        if why:
            raise AudioDecodeError(f"{name}: truncated OGG: {why}")
    slack = MPEG_FRAME_SAMPLES if container == "MPEG" else 0
    if container != "WAV" and declared > 0 and decoded + slack < declared:
        raise AudioDecodeError(
            f"{name}: truncated or corrupt {container}: {decoded} of the {declared} samples its header declares decode"
        )


def downmix(data: np.ndarray) -> np.ndarray:
    """(frames, channels) float32 → the channels' mean, (frames,) float32.

    Channel by channel: bit-identical to ``data.mean(axis=1, dtype=np.float32)`` (a sum, then a
    division) but ~30× faster on a (frames, 2) array, where numpy's reduction over the short
    axis cost as much as decoding the FLAC.
    """
    if data.shape[1] == 1:
        return data[:, 0]
    mono = data[:, 0].copy()
    for channel in range(1, data.shape[1]):
        mono += data[:, channel]
    mono /= np.float32(data.shape[1])
    return mono


def decode_estimate(frames: int, channels: int, rate: int, sample_rate: int) -> int:
    """Peak bytes :func:`decode_audio` allocates for a stream of ``frames`` × ``channels`` at ``rate``.

    Decoding reads :data:`DECODE_BLOCK_FRAMES` frames at a time into one float32 block of every
    channel, mixes the block down to mono and feeds it to a streaming resampler: the only arrays
    that grow with the clip are the output chunks at ``sample_rate`` and their concatenation
    (twice the output). The source's rate and channel count cost one block, never the clip.
    """
    block = DECODE_BLOCK_FRAMES * (max(1, channels) + 1) * 4
    out = resampled_length(max(0, frames), max(1, rate), sample_rate) * 4
    return block + 2 * out + RESAMPLER_BYTES


def check_decode_header(
    name: str, frames: int, channels: int, rate: int, sample_rate: int, *,
    max_seconds: float | None = None, max_samples: int | None = None, max_bytes: int | None = None,
    min_sample_rate: int | None = None,
) -> None:
    """Refuse, from the header alone, a stream whose decoding would pass a limit: its rate below
    ``min_sample_rate``, its duration (``max_seconds``), the samples to decode (frames × channels,
    ``max_samples``: the CPU a decode costs) or :func:`decode_estimate` (``max_bytes``). A header that does
    not know its length (``frames`` ≤ 0) is bounded while decoding instead (:func:`decode_audio` stops at
    the limits)."""
    if min_sample_rate is not None and rate < min_sample_rate:
        raise AudioRateError(
            f"{name}: sample rate {rate} Hz is below the floor of {min_sample_rate} Hz (resampling to {sample_rate} Hz "
            f"would turn each of its {max(frames, 0)} frames into {sample_rate / max(rate, 1):,.0f} samples)"
        )
    if frames <= 0:
        return
    if max_seconds is not None and frames / rate > max_seconds:
        raise AudioTooLongError(f"{name}: {frames / rate:.1f} s of audio exceeds the limit of {max_seconds:g} s")
    if max_samples is not None and frames * channels > max_samples:
        raise AudioTooLargeError(
            f"{name}: {frames} frames × {channels} channels = {frames * channels} samples to decode exceed "
            f"the limit of {max_samples} (e.g. {frames / rate:.1f} s at {rate} Hz)"
        )
    if max_bytes is not None:
        cost = decode_estimate(frames, channels, rate, sample_rate)
        if cost > max_bytes:
            raise AudioTooLargeError(f"{name}: decoding needs ~{cost} bytes; the limit is {max_bytes}")


def _mono_blocks(
    source: Path | str | bytes, *, sample_rate: int | None, max_seconds: float | None, complete: bool = False,
    max_samples: int | None = None, max_bytes: int | None = None, min_sample_rate: int | None = None,
    output_grows: bool = True,
) -> Iterator[tuple[np.ndarray, int]]:
    """``(block, rate)`` of float32 mono — at ``sample_rate`` (streaming resampler) or at the file's own rate
    (``None``) — :data:`DECODE_BLOCK_FRAMES` source frames at a time, with the limits checked from the header
    before decoding and again as blocks arrive (a header may lie about its length: MP3 without a Xing/Info
    frame count). A block may be a view of the decoder's buffer (valid until the next one is asked for) and
    may be empty (the resampler's delay). ``output_grows`` (the caller keeps every block): ``max_bytes``
    also bounds the frames decoded; a caller that keeps a bounded part checks ``max_bytes`` itself."""
    name = _describe(source)
    with _open(source) as f:
        rate, channels, declared = int(f.samplerate), int(f.channels), int(f.frames)
        target = rate if sample_rate is None else sample_rate
        check_decode_header(name, declared, channels, rate, target, max_seconds=max_seconds,
                            max_samples=max_samples, max_bytes=max_bytes if output_grows else None,
                            min_sample_rate=min_sample_rate)
        most = None if max_samples is None else max_samples // max(1, channels)
        if max_bytes is not None and output_grows:  # the output a decode may grow to (a header that lies)
            most = min(most if most is not None else sys.maxsize,
                       _frames_within(max_bytes, channels, rate, target))
        resampler = soxr.ResampleStream(rate, target, 1, dtype="float32", quality="HQ") if target != rate else None
        block = np.empty((DECODE_BLOCK_FRAMES, max(1, channels)), dtype=np.float32)
        decoded = 0
        while True:
            try:
                data = f.read(DECODE_BLOCK_FRAMES, dtype="float32", always_2d=True, out=block)
            except (sf.LibsndfileError, RuntimeError, ValueError) as err:
                raise AudioDecodeError(f"{name}: corrupt audio data: {libsndfile_message(err)}") from None
            if data.shape[0] == 0:
                break
            decoded += data.shape[0]
            if max_seconds is not None and decoded / rate > max_seconds:
                raise AudioTooLongError(f"{name}: more than {decoded / rate:.1f} s of audio (the header declared "
                                        f"{max(declared, 0) / rate:.1f} s) exceeds the limit of {max_seconds:g} s")
            if most is not None and decoded > most:
                raise AudioTooLargeError(f"{name}: more than {decoded} frames × {channels} channels decode "
                                         f"(the header declared {max(declared, 0)}); past the decoding limits")
            mono = downmix(data)
            if not np.all(np.isfinite(mono)):
                raise AudioDecodeError(f"{name}: audio contains NaN or infinite samples")
            yield (resampler.resample_chunk(mono, last=False) if resampler is not None else mono), target
        if complete:
            _check_complete(source, str(f.format), declared, decoded)
    if decoded == 0:
        raise AudioDecodeError(f"{name}: contains no audio samples")
    if resampler is not None:
        yield resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True), target


def _read_mono(
    source: Path | str | bytes, *, sample_rate: int | None, max_seconds: float | None, complete: bool = False,
    max_samples: int | None = None, max_bytes: int | None = None, min_sample_rate: int | None = None,
) -> tuple[np.ndarray, int]:
    """The whole clip as float32 mono (:func:`_mono_blocks` concatenated) and its rate."""
    chunks: list[np.ndarray] = []
    target = sample_rate or 0
    for mono, rate in _mono_blocks(source, sample_rate=sample_rate, max_seconds=max_seconds, complete=complete,
                                   max_samples=max_samples, max_bytes=max_bytes, min_sample_rate=min_sample_rate):
        target = rate
        chunks.append(mono if mono.base is None else mono.copy())  # a view of the decoder's block: copied
    mono = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
    return np.ascontiguousarray(mono, dtype=np.float32), target


def stream_estimate(channels: int, rate: int, sample_rate: int) -> int:
    """Peak bytes :func:`decode_blocks` allocates at once, whatever the stream's length: one float32 block
    of every channel, its mono mix, the resampled block and the resampler's state."""
    out = resampled_length(DECODE_BLOCK_FRAMES, max(1, rate), sample_rate) + 1
    return DECODE_BLOCK_FRAMES * (max(1, channels) + 1) * 4 + out * 4 + RESAMPLER_BYTES


def decode_blocks(
    source: Path | str | bytes, *, sample_rate: int, max_seconds: float | None = None, complete: bool = False,
    max_samples: int | None = None, min_sample_rate: int | None = None,
) -> Iterator[np.ndarray]:
    """:func:`decode_audio` by blocks: float32 mono at ``sample_rate`` in [-1, 1], concatenating to what
    :func:`decode_audio` returns (same limits and checks), one block of :data:`DECODE_BLOCK_FRAMES` source
    frames at a time — so a recording of any length costs :func:`stream_estimate`, never its decoded length.
    Each yielded array is the caller's (not reused); ``max_bytes`` does not apply (nothing grows)."""
    for mono, _ in _mono_blocks(source, sample_rate=sample_rate, max_seconds=max_seconds, complete=complete,
                                max_samples=max_samples, min_sample_rate=min_sample_rate, output_grows=False):
        if mono.size:
            out = mono.copy() if mono.base is not None else mono
            yield np.clip(out, -1.0, 1.0, out=out)


def _frames_within(max_bytes: int, channels: int, rate: int, sample_rate: int) -> int:
    """Most source frames whose decoding stays within ``max_bytes`` (:func:`decode_estimate` inverted)."""
    room = max(0, max_bytes - decode_estimate(0, channels, rate, sample_rate)) // 8  # 2 × 4 bytes per output sample
    return room * rate // sample_rate + -(-rate // sample_rate)  # + one output sample: the header's rounding


def decode_audio(
    source: Path | str | bytes, *, sample_rate: int = 16000, max_seconds: float | None = None,
    complete: bool = False, max_samples: int | None = None, max_bytes: int | None = None,
    min_sample_rate: int | None = None,
) -> np.ndarray:
    """Decode a file path or raw bytes to float32 mono at ``sample_rate`` in [-1, 1].

    Channels are averaged; soxr (high quality) resamples when the file's rate
    differs. Decoding is bounded: :data:`DECODE_BLOCK_FRAMES` frames are read at a time,
    mixed down and streamed through the resampler (bit-identical to resampling the whole
    clip), so memory is :func:`decode_estimate` — the output, not the source's channels or rate.
    ``max_seconds`` rejects longer audio with :class:`AudioTooLongError`, ``max_samples``
    (frames × channels) and ``max_bytes`` (:func:`decode_estimate`) with
    :class:`AudioTooLargeError`: checked from the header before decoding, and again while
    decoding, which stops at the limit when the header lied. ``min_sample_rate`` rejects a
    source rate below it with :class:`AudioRateError` (:data:`MIN_SAMPLE_RATE`; :class:`DecodeLimits`
    holds a catalogue pass's three).
    ``complete`` (uploads, ``tonearm index``) also refuses a stream cut short
    (index.audio.formats): libsndfile alone decodes whatever part of a truncated WAV is there.

    Raises:
        AudioDecodeError: missing, empty, unreadable, corrupt or non-audio input;
            the message names the file (or says "uploaded audio" for bytes).
    """
    mono, _ = _read_mono(source, sample_rate=sample_rate, max_seconds=max_seconds, complete=complete,
                         max_samples=max_samples, max_bytes=max_bytes, min_sample_rate=min_sample_rate)
    if mono.size == 0:
        raise AudioDecodeError(f"{_describe(source)}: too short to resample to {sample_rate} Hz")
    return np.clip(mono, -1.0, 1.0, out=mono)


def fit_length(
    wave: np.ndarray, n: int, *, mode: CropMode, rng: np.random.Generator | None = None,
    padding: Padding = "pad",
) -> np.ndarray:
    """Crop or pad a 1-D waveform to exactly ``n`` samples.

    Longer input: ``start`` keeps the first ``n`` samples, ``center`` the middle
    ones (offset ``(len - n) // 2``), ``random`` a uniformly drawn window (needs
    ``rng``). Shorter input is padded at the end in every mode: zeros (``pad``), or tiled
    as the model's own feature extractor does (``repeatpad``/``repeat``, :mod:`index.audio.frontend`).
    """
    if n <= 0:
        raise ValueError(f"target length must be positive, got {n}")
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim != 1:
        raise ValueError(f"expected a 1-D waveform, got shape {wave.shape}")
    excess = wave.shape[0] - n
    if excess <= 0:
        wave = pad_short_clip(wave, n, padding)
        out = np.zeros(n, dtype=np.float32)
        out[: wave.shape[0]] = wave
        return out
    offset = crop_offset(excess, mode=mode, rng=rng)
    return wave[offset : offset + n].copy()


def crop_offset(excess: int, *, mode: CropMode, rng: np.random.Generator | None = None) -> int:
    """Where a crop of a waveform ``excess`` samples longer than the crop starts (one rng draw for
    ``random``): shared by :func:`fit_length` and :func:`decode_window` so both pick the same window."""
    if mode == "start":
        return 0
    if mode == "center":
        return excess // 2
    if mode == "random":
        if rng is None:
            raise ValueError("mode='random' needs an rng")
        return int(rng.integers(0, excess + 1))
    raise ValueError(f"unknown crop mode {mode!r}; use center, random or start")


def resampled_length(frames: int, rate: int, sample_rate: int) -> int:
    """Samples soxr produces from ``frames`` at ``rate`` → ``sample_rate``: round(frames × sr / rate)."""
    return (2 * frames * sample_rate + rate) // (2 * rate)


def decode_window(
    source: Path | str | bytes, *, sample_rate: int, n: int, mode: CropMode,
    rng: np.random.Generator | None = None, padding: Padding = "pad", min_sample_rate: int | None = None,
    max_samples: int | None = None, max_bytes: int | None = None,
) -> np.ndarray:
    """``fit_length(decode_audio(source), n, mode=mode, rng=rng)``, decoding only that window.

    The window's offset is drawn at ``sample_rate`` from the header's length exactly as
    :func:`fit_length` draws it from the decoded clip (same rng draw), then only the source
    samples under the window — plus :data:`RESAMPLE_MARGIN_SECONDS` each side, so the
    resampler's filter sees the same neighbourhood — are read (libsndfile seeks), downmixed and
    resampled. The first source sample read sits on the rates' common grid (a multiple of
    ``rate / gcd(rate, sample_rate)``), so the resampled chunk lines up with the whole clip's
    samples: equal to decode-then-crop sample for sample at the same rate, within float
    rounding (~1e-7) across rates. Cost is that of the window, not of the file (SPEC §13).

    Falls back to decoding the whole file when the window is the whole clip (short clips, which
    are padded with ``padding``; a clip of exactly ``n`` samples at ``sample_rate`` is read directly), when
    the header does not know the length, or for MP3 (whose frame count
    is approximate).

    ``min_sample_rate`` refuses a source rate below it (:class:`AudioRateError`); ``max_samples`` and
    ``max_bytes`` bound a whole-file decode as :func:`decode_audio`'s do (a window costs its own length).

    Raises:
        AudioDecodeError: as :func:`decode_audio`, and when the file holds fewer samples than
            its header declares (the window would come from the wrong place).
    """
    if n <= 0:
        raise ValueError(f"target length must be positive, got {n}")
    with _open(source) as f:
        rate, frames = int(f.samplerate), int(f.frames)
        if min_sample_rate is not None:
            check_decode_header(_describe(source), frames, int(f.channels), rate, sample_rate,
                                min_sample_rate=min_sample_rate)
        length = resampled_length(frames, rate, sample_rate) if frames > 0 else 0
        # A clip exactly the window's length at the model's rate (10-s clips sharded at the model's rate)
        # is read whole through the same fast path: fit_length draws no offset for it, neither do we.
        exact = length == n and rate == sample_rate
        windowed = f.seekable() and str(f.format) != "MPEG" and (length > n or exact)
        if windowed:
            offset = 0 if exact else crop_offset(length - n, mode=mode, rng=rng)
            if rate == sample_rate:
                start, stop = offset, offset + n
            else:
                grid = rate // math.gcd(rate, sample_rate)
                margin = math.ceil(RESAMPLE_MARGIN_SECONDS * rate)
                start = max(0, (offset * rate // sample_rate - margin) // grid * grid)
                stop = min(frames, -(-(offset + n) * rate // sample_rate) + margin)
            try:
                f.seek(start)
                data = f.read(stop - start, dtype="float32", always_2d=True)
            except (sf.LibsndfileError, RuntimeError, ValueError) as err:
                raise AudioDecodeError(
                    f"{_describe(source)}: corrupt audio data: {libsndfile_message(err)}"
                ) from None
    if not windowed:
        whole = decode_audio(source, sample_rate=sample_rate, max_samples=max_samples, max_bytes=max_bytes)
        return fit_length(whole, n, mode=mode, rng=rng, padding=padding)
    if data.shape[0] != stop - start:
        raise AudioDecodeError(
            f"{_describe(source)}: truncated or corrupt: {data.shape[0]} of the {stop - start} samples "
            f"at {start}..{stop} decode (the header declares {frames})"
        )
    mono = downmix(data)
    if not np.all(np.isfinite(mono)):
        raise AudioDecodeError(f"{_describe(source)}: audio contains NaN or infinite samples")
    if rate != sample_rate:
        first = offset - start * sample_rate // rate
        mono = soxr.resample(mono, rate, sample_rate, quality="HQ")[first : first + n]
    return np.clip(np.ascontiguousarray(mono, dtype=np.float32), -1.0, 1.0)


def eval_chunks(wave: np.ndarray, n: int, padding: Padding = "pad") -> np.ndarray:
    """Split a waveform into the (C, n) windows of the chunk-and-average policy.

    ``len <= n`` gives one window padded with ``padding`` (zeros by default, see :func:`fit_length`); longer clips give ``ceil(len / n)``
    non-overlapping windows starting at 0, n, 2n, … with the last one moved left
    so that it ends exactly at the end of the clip (it may overlap its neighbour). With ``reflect``
    (PE-Audio, ``audio_frontend.long_clips = "whole"``) a longer clip is one window of its own length.
    """
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim != 1:
        raise ValueError(f"expected a 1-D waveform, got shape {wave.shape}")
    if wave.shape[0] <= n:
        return fit_length(wave, n, mode="start", padding=padding)[None, :]
    if padding == "reflect":  # PE-Audio: the model's own forward over the whole clip (long_clips="whole")
        return wave[None, :]
    count = -(-wave.shape[0] // n)
    starts = [i * n for i in range(count - 1)] + [wave.shape[0] - n]
    return np.stack([wave[s : s + n] for s in starts]).astype(np.float32, copy=False)
