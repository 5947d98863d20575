"""Moment windows in the catalogue pass (issue 54, part 5; SPEC §19, docs/bundle.md "Moments").

A catalogue file longer than :data:`~index.moments.windows.LONG_RECORDING_WINDOWS` windows is searched for
moments by its windows (:func:`index.moments.windows.embed_windows`: the model's window every
:data:`~index.moments.windows.HOP_FRACTION` of it, the last one ending at the recording's end). The clips
pass makes them from the waveform it decodes for the clip vector — one decode per file:

* :class:`WindowedDecode` wraps the pass's decode function (picklable: it runs in the decode workers and
  the device processes). It returns a :class:`Decoded`: the clip's waveform as the pass embeds it and, for
  a long recording, the whole recording. When the clip decode crops (a trained bundle's ``center``
  evaluation crop decodes only the center window) a file whose header says it is long is decoded whole
  once and cropped in memory (:func:`index.audio.decode.decode_window` equals decode-then-crop); a file
  the header says is short keeps the cheap clip decode.
* The process that encodes the clip (:func:`index.catalogue.embed_pass.clip_embedder`, a device process of
  ``--devices``, a Ray actor) encodes its windows with the same encoder, as soon as it is decoded (so a
  long recording is held once, not until the next length-sorted call), and hands them back with the chunk;
  the checkpoint saves them with the clip vector (:mod:`index.catalogue.checkpoint`).
* :func:`bundle_windows` lays the pass's windows out by the rows of the bundle's audio index (the clips
  kept, skipped ones left out) for :func:`index.moments.windows.write_bundle_windows`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile as sf

from index.catalogue.checkpoint import Windows
from index.errors import AudioDecodeError
from index.moments.windows import HOP_FRACTION, LONG_RECORDING_WINDOWS, embed_windows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowPlan:
    """The windows of a bundle whose model reads ``window_samples`` at ``sample_rate``."""

    sample_rate: int
    window_samples: int

    @property
    def hop_samples(self) -> int:
        return max(1, int(round(self.window_samples * HOP_FRACTION)))

    def is_long(self, samples: int) -> bool:
        return samples > LONG_RECORDING_WINDOWS * self.window_samples

    def describe(self) -> dict[str, Any]:
        """What decides the windows besides the encoder (part of a windowing pass's checkpoint digest)."""
        return {"window_samples": self.window_samples, "hop_samples": self.hop_samples,
                "long_after_windows": LONG_RECORDING_WINDOWS}

    def embed(self, whole: np.ndarray, encode: Callable[[Sequence[np.ndarray]], np.ndarray]) -> Windows:
        """The recording's windows, encoded by ``encode`` (the pass's encoder)."""
        return embed_windows(whole, sample_rate=self.sample_rate, window_samples=self.window_samples,
                             hop_samples=self.hop_samples, encode=encode)


@dataclass(frozen=True)
class Decoded:
    """A decoded catalogue file: the waveform its clip vector is embedded from, and the whole recording when
    it is long (its moment windows; the same array as ``clip`` when the pass embeds the whole file)."""

    clip: np.ndarray
    whole: np.ndarray | None = None


@dataclass(frozen=True)
class WindowedDecode:
    """The pass's decode function ``decode`` (path → the clip's waveform) that also keeps a long recording
    whole (:class:`Decoded`). ``whole`` and ``prepare``: for a ``decode`` that does not return the whole file
    (a center crop), the whole file's decode and the crop of it that ``decode`` gives; both picklable."""

    decode: Callable[[Any], np.ndarray]
    plan: WindowPlan
    whole: Callable[[Any], np.ndarray] | None = None
    prepare: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def sample_rate(self) -> int | None:
        """The rate the pass's decode memory budget counts the file at (:class:`index.catalogue.embed_pass.Decoder`)."""
        return getattr(self.decode, "sample_rate", None)

    def __call__(self, path: Any) -> Decoded:
        if self.whole is None or self.prepare is None:
            wave = np.ascontiguousarray(self.decode(path), dtype=np.float32)
            return Decoded(wave, wave if self.plan.is_long(len(wave)) else None)
        seconds = header_seconds(path)
        if seconds is not None and not self.plan.is_long(int(seconds * self.plan.sample_rate) + 1):
            return Decoded(np.ascontiguousarray(self.decode(path), dtype=np.float32))
        try:
            whole = np.ascontiguousarray(self.whole(path), dtype=np.float32)
        except AudioDecodeError as err:  # past a limit the window decode does not hit: the clip alone, as before
            log.warning("%s: no moment windows (%s); its clip vector is embedded from its center", path, err)
            return Decoded(np.ascontiguousarray(self.decode(path), dtype=np.float32))
        clip = np.ascontiguousarray(self.prepare(whole), dtype=np.float32)
        return Decoded(clip, whole if self.plan.is_long(len(whole)) else None)


def header_seconds(path: Any) -> float | None:
    """The duration a file's header declares (None: unknown — decode it to know)."""
    try:
        info = sf.info(str(path))
    except Exception:  # noqa: BLE001 - not readable by libsndfile: the decoder says why
        return None
    return float(info.frames) / info.samplerate if info.frames > 0 and info.samplerate > 0 else None


def encode_windows(plan: WindowPlan, whole: np.ndarray, encode: Callable[[Sequence[np.ndarray]], np.ndarray],
                   clock: Any = None) -> Windows:
    """:meth:`WindowPlan.embed`, its time counted as the encoder's (``clock``: a
    :class:`~index.catalogue.embed_pass.PassClock`, whose progress counts the windows)."""
    began = time.monotonic()
    found = plan.embed(whole, encode)
    if clock is not None:
        clock.encode_busy += time.monotonic() - began
        clock.count_windows(len(found[0]))
    return found


def bundle_windows(clip_ids: Sequence[str], windows: Mapping[str, Windows]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``(row, spans, vectors)`` of each long recording, ``row`` its clip's row among ``clip_ids`` (the
    bundle's audio index, skipped clips left out): what :func:`index.moments.windows.write_bundle_windows` writes."""
    return [(row, *windows[clip_id]) for row, clip_id in enumerate(clip_ids) if clip_id in windows]


def serialize_windows(found: Windows | None) -> bytes:
    """A recording's windows as bytes (a Ray Data column; ``b""`` for none)."""
    if found is None or not len(found[0]):
        return b""
    spans, vectors = found
    return np.asarray(spans, "<f8").tobytes() + np.asarray(vectors, "<f4").tobytes()


def deserialize_windows(data: bytes, dim: int) -> Windows | None:
    """:func:`serialize_windows`'s inverse (``dim``: the vectors' width)."""
    if not data:
        return None
    n = len(data) // (2 * 8 + dim * 4)
    spans = np.frombuffer(data, "<f8", count=2 * n).reshape(n, 2).astype(np.float64)
    vectors = np.frombuffer(data, "<f4", offset=16 * n).reshape(n, dim).astype(np.float32)
    return spans, vectors

