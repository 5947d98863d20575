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
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Literal, TypeVar

import numpy as np
import soundfile as sf
import soxr

from index.audio_formats import missing_bytes, ogg_cut_short
from index.audio_frontend import Padding, pad_short_clip
from index.errors import AudioDecodeError

_T = TypeVar("_T")

CropMode = Literal["center", "random", "start"]


class AudioTooLongError(AudioDecodeError):
    """Audio longer than the caller's ``max_seconds`` limit (the service answers 413)."""


OBJECT_REPR = re.compile(r"Error opening <[^<>]*? at 0x[0-9a-fA-F]+>: |<[^<>]*? object at 0x[0-9a-fA-F]+>")
RESAMPLE_MARGIN_SECONDS = 0.05
"""Source audio read beyond each side of a window (:func:`decode_window`): soxr HQ's filter
reaches ~10 ms; 50 ms makes the window's samples those of the whole clip's resampling."""
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
    STREAMINFO, MP3 Xing/Info; index.audio_formats)."""
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


def _read_mono(
    source: Path | str | bytes, *, max_seconds: float | None, complete: bool = False
) -> tuple[np.ndarray, int]:
    """Decode to float32 mono at the file's own rate, enforcing ``max_seconds`` before decoding."""
    name = _describe(source)
    with _open(source) as f:
        rate = int(f.samplerate)
        if max_seconds is not None and f.frames > 0 and f.frames / rate > max_seconds:
            raise AudioTooLongError(
                f"{name}: {f.frames / rate:.1f} s of audio exceeds the limit of {max_seconds:g} s"
            )
        try:
            data = f.read(dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError, ValueError) as err:
            raise AudioDecodeError(f"{name}: corrupt audio data: {libsndfile_message(err)}") from None
        if complete:
            _check_complete(source, str(f.format), int(f.frames), int(data.shape[0]))
    if data.shape[0] == 0:
        raise AudioDecodeError(f"{name}: contains no audio samples")
    if max_seconds is not None and data.shape[0] / rate > max_seconds:
        raise AudioTooLongError(
            f"{name}: {data.shape[0] / rate:.1f} s of audio exceeds the limit of {max_seconds:g} s"
        )
    mono = downmix(data)
    if not np.all(np.isfinite(mono)):
        raise AudioDecodeError(f"{name}: audio contains NaN or infinite samples")
    return np.ascontiguousarray(mono, dtype=np.float32), rate


def decode_audio(
    source: Path | str | bytes, *, sample_rate: int = 16000, max_seconds: float | None = None,
    complete: bool = False,
) -> np.ndarray:
    """Decode a file path or raw bytes to float32 mono at ``sample_rate`` in [-1, 1].

    Channels are averaged; soxr (high quality) resamples when the file's rate
    differs. ``max_seconds`` rejects longer audio with :class:`AudioTooLongError`
    (checked from the header before decoding when the header knows the length).
    ``complete`` (uploads, ``tonearm index``) also refuses a stream cut short
    (index.audio_formats): libsndfile alone decodes whatever part of a truncated WAV is there.

    Raises:
        AudioDecodeError: missing, empty, unreadable, corrupt or non-audio input;
            the message names the file (or says "uploaded audio" for bytes).
    """
    mono, rate = _read_mono(source, max_seconds=max_seconds, complete=complete)
    if rate != sample_rate:
        mono = soxr.resample(mono, rate, sample_rate, quality="HQ").astype(np.float32, copy=False)
        if mono.size == 0:
            raise AudioDecodeError(f"{_describe(source)}: too short to resample to {sample_rate} Hz")
    return np.clip(mono, -1.0, 1.0)


def fit_length(
    wave: np.ndarray, n: int, *, mode: CropMode, rng: np.random.Generator | None = None,
    padding: Padding = "pad",
) -> np.ndarray:
    """Crop or pad a 1-D waveform to exactly ``n`` samples.

    Longer input: ``start`` keeps the first ``n`` samples, ``center`` the middle
    ones (offset ``(len - n) // 2``), ``random`` a uniformly drawn window (needs
    ``rng``). Shorter input is padded at the end in every mode: zeros (``pad``), or tiled
    as the model's own feature extractor does (``repeatpad``/``repeat``, :mod:`index.audio_frontend`).
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
    rng: np.random.Generator | None = None, padding: Padding = "pad",
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

    Raises:
        AudioDecodeError: as :func:`decode_audio`, and when the file holds fewer samples than
            its header declares (the window would come from the wrong place).
    """
    if n <= 0:
        raise ValueError(f"target length must be positive, got {n}")
    with _open(source) as f:
        rate, frames = int(f.samplerate), int(f.frames)
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
        return fit_length(decode_audio(source, sample_rate=sample_rate), n, mode=mode, rng=rng, padding=padding)
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
