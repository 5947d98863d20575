"""Window embeddings of long recordings and the moment search over them (SPEC §19, docs/bundle.md "Moments").

A recording longer than the model's window (the bundle's ``clip_seconds``) is embedded as windows
of that length every ``hop`` seconds (:func:`index.moments.postprocess.window_spans`: the last window ends at
the recording's end), each window the model's own input length, so no padding is involved. The
bundle stores them beside its clip index:

* ``moments/windows.npy`` — ``(W, d)`` float32, L2-normalized, grouped by recording in time order;
* ``moments/spans.npy`` — ``(W, 3)`` float64: the recording's row in ``audio_ids.jsonl``, start, end.

:class:`ExactWindows` searches windows exactly, in memory (one matrix-vector product over every window:
~W·d multiply-adds, 7,200 windows for 10 h of audio at a 5-s hop): a bundle's below
:data:`index.moments.faiss_windows.FAISS_MIN_WINDOWS` and the added items' on the file backend. It is one
:class:`index.moments.sources.WindowSource`; :func:`index.moments.sources.search_sources` turns the
recordings the sources name into moments (:func:`index.moments.postprocess.moments_from_scores`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from index.bundle.format import MomentsInfo
from index.errors import BundleError
from index.moments.head import MomentHeadModel
from index.moments.postprocess import MomentParams, window_spans
from index.moments.sources import Allowed, Key, search_sources

WINDOWS_FILE = "moments/windows.npy"
SPANS_FILE = "moments/spans.npy"
HOP_FRACTION = 0.5
"""Windows overlap by half: the hop is half the model's window."""
LONG_RECORDING_WINDOWS = 2
"""A recording is *long* (indexed as windows) when it lasts more than this many windows; a shorter
one is found by its clip vector, and is at most two windows long anyway."""
ENCODE_BATCH = 16
STREAM_CALL_SAMPLES = 1 << 20
"""Most window samples one encoder call of :func:`embed_stream` takes (at least one window): ~65 s at 16 kHz,
~22 s at 48 kHz — what bounds the windows a streamed recording holds at once (:func:`stream_embed_bytes`)."""


def embed_windows(
    waveform: np.ndarray, *, sample_rate: int, window_samples: int, hop_samples: int,
    encode: Callable[[Sequence[np.ndarray]], np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """``(spans (n, 2) seconds, vectors (n, d) L2-normalized)`` of one recording's windows; empty
    when it is no longer than one window (its clip vector is the whole story)."""
    n = int(waveform.shape[0])
    if n <= window_samples:
        return np.zeros((0, 2)), np.zeros((0, 0), dtype=np.float32)
    starts = np.rint(window_spans(n, window_samples, hop_samples)[:, 0]).astype(np.int64)
    chunks = []
    for i in range(0, len(starts), ENCODE_BATCH):
        batch = [waveform[s : s + window_samples] for s in starts[i : i + ENCODE_BATCH]]
        chunks.append(np.asarray(encode(batch), dtype=np.float32))
    vectors = np.concatenate(chunks)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    spans = np.stack([starts, starts + window_samples], axis=1) / float(sample_rate)
    return spans, vectors


@dataclass(frozen=True)
class StreamedRecording:
    """A recording embedded by blocks (:func:`embed_stream`): its length in samples, its clip vector and,
    when it is long (more than :data:`LONG_RECORDING_WINDOWS` windows), its moment windows."""

    samples: int
    clip: np.ndarray
    """(d,) L2-normalized: the clip embedding the bundle's encoder gives the whole waveform
    (:func:`index.runtime.loader.encode_waveforms`: the mean of its non-overlapping windows, the last one
    right-aligned to the end; a recording of at most one window is encoded whole)."""
    spans: np.ndarray
    """(n, 2) seconds of the moment windows (:func:`embed_windows`'s); (0, 2) for a recording that is not long."""
    vectors: np.ndarray
    """(n, d) L2-normalized window vectors; (0, 0) for a recording that is not long."""


def _stream_starts(window: int, hop: int) -> Iterator[int]:
    """Every start :func:`embed_stream` may need, increasing: the hop's multiples (moment windows) and the
    window's (the clip's chunks)."""
    at_hop, at_window = 0, 0
    while True:
        start = min(at_hop, at_window)
        yield start
        if at_hop == start:
            at_hop += hop
        if at_window == start:
            at_window += window


def windows_per_call(window_samples: int) -> int:
    """Windows of one encoder call of :func:`embed_stream` (:data:`STREAM_CALL_SAMPLES`, at least one)."""
    return max(1, min(ENCODE_BATCH, STREAM_CALL_SAMPLES // max(1, window_samples)))


def stream_embed_bytes(window_samples: int, hop_samples: int, block_samples: int) -> int:
    """Peak bytes :func:`embed_stream` holds besides its input blocks and the vectors: the samples kept for
    the next call's windows (twice while they are joined to the blocks that arrived) and the encoder's
    copies of one call's windows (the windowing's and the batch's), float32 — whatever the recording's length."""
    per_call = windows_per_call(window_samples)
    kept = window_samples + (per_call - 1) * hop_samples + block_samples
    return 4 * (2 * kept + 2 * per_call * window_samples)


def embed_stream(
    blocks: Iterable[np.ndarray], *, sample_rate: int, window_samples: int, hop_samples: int,
    encode: Callable[[Sequence[np.ndarray]], np.ndarray],
) -> StreamedRecording:
    """Embed a recording that arrives by blocks (:func:`index.audio.decode.decode_blocks`) without holding
    it: windows are encoded as soon as their samples are there (:func:`windows_per_call` a call) and only
    the samples later windows still need are kept (:func:`stream_embed_bytes`).

    The same vectors as the whole waveform gives: the moment windows of :func:`embed_windows` (every
    ``hop_samples``, the last one ending at the end; only for a recording longer than
    :data:`LONG_RECORDING_WINDOWS` windows), and the clip vector of ``encode([waveform])`` for an encoder
    that chunks and averages (``index.audio.decode.eval_chunks``: the L2-normalized mean of the windows at
    multiples of ``window_samples``, the last one right-aligned) — each window's vector is ``encode``'s,
    already normalized, as the bundle's encoders give it. A recording of at most one window is passed
    to ``encode`` whole (its padding is the encoder's)."""
    n, h = int(window_samples), int(hop_samples)
    if n <= 0 or h <= 0 or h > n:
        raise ValueError(f"need 0 < hop <= window, got window={n}, hop={h}")
    per_call = windows_per_call(n)
    starts = _stream_starts(n, h)
    batch = [next(starts) for _ in range(per_call)]
    kept = np.zeros(0, np.float32)  # samples from kept_at on
    kept_at = 0
    pending: list[np.ndarray] = []
    total = 0
    found: dict[int, np.ndarray] = {}

    def run(todo: list[int]) -> None:
        vectors = np.asarray(encode([kept[s - kept_at : s - kept_at + n] for s in todo]), dtype=np.float32)
        found.update(zip(todo, vectors, strict=True))

    for block in blocks:
        pending.append(np.asarray(block, dtype=np.float32))
        total += len(pending[-1])
        while total >= batch[-1] + n:
            kept = np.concatenate([kept, *pending])
            pending = []
            run(batch)
            batch = [next(starts) for _ in range(per_call)]
            kept, kept_at = kept[batch[0] - kept_at :].copy(), batch[0]
    kept = np.concatenate([kept, *pending]) if pending else kept
    if total < n:  # shorter than a window: the encoder's own handling (and padding) of the whole clip
        if total == 0:
            raise ValueError("the recording holds no samples")
        clip = np.asarray(encode([kept]), dtype=np.float32)[0]
        return StreamedRecording(total, _unit(clip), np.zeros((0, 2)), np.zeros((0, 0), np.float32))
    last = total - n
    rest = [s for s in batch if s <= last]  # every start up to the last is in this batch or done
    todo = rest + ([last] if last not in found and last not in rest else [])
    for first in range(0, len(todo), per_call):
        run(todo[first : first + per_call])
    chunk_starts = [s for s in found if s % n == 0 and s <= last]
    if total % n:
        chunk_starts.append(last)
    clip = np.sum([found[s].astype(np.float64) for s in sorted(set(chunk_starts))], axis=0)
    if total <= LONG_RECORDING_WINDOWS * n:
        return StreamedRecording(total, _unit(clip), np.zeros((0, 2)), np.zeros((0, 0), np.float32))
    moment_starts = sorted(s for s in found if s % h == 0 and s <= last)
    if moment_starts[-1] != last:
        moment_starts.append(last)
    vectors = np.stack([found[s] for s in moment_starts]).astype(np.float32)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    spans = np.stack([np.asarray(moment_starts), np.asarray(moment_starts) + n], axis=1) / float(sample_rate)
    return StreamedRecording(total, _unit(clip), spans, vectors)


def _unit(vector: np.ndarray) -> np.ndarray:
    vector = np.asarray(vector, dtype=np.float64)
    return (vector / max(float(np.linalg.norm(vector)), 1e-12)).astype(np.float32)


def write_windows(root: Path, recordings: Sequence[tuple[int, np.ndarray, np.ndarray]]) -> tuple[int, int]:
    """Write ``(clip row, spans, vectors)`` of each long recording under ``root``; (windows, recordings)."""
    kept = [(row, spans, vectors) for row, spans, vectors in recordings if len(spans)]
    (root / WINDOWS_FILE).parent.mkdir(parents=True, exist_ok=True)
    if kept:
        vectors = np.concatenate([v for _, _, v in kept]).astype(np.float32)
        spans = np.concatenate([np.column_stack([np.full(len(s), row, dtype=np.float64), s]) for row, s, _ in kept])
    else:
        vectors, spans = np.zeros((0, 0), dtype=np.float32), np.zeros((0, 3))
    np.save(root / WINDOWS_FILE, vectors, allow_pickle=False)
    np.save(root / SPANS_FILE, spans, allow_pickle=False)
    return len(spans), len(kept)


@dataclass(frozen=True)
class MomentHit:
    """A moment of the recording at catalogue row ``row``."""

    row: int
    start: float
    end: float
    score: float


ALLOWED_CHUNK = 64
"""Recordings :meth:`ExactWindows.best_recordings` hands ``allowed`` at a time (at least ``n``): a filter that
asks the engine (hidden clips on Milvus) is asked about the next best few, not about every recording."""


class ExactWindows:
    """Windows searched exactly, in memory (module docstring): a bundle's below
    :data:`index.moments.faiss_windows.FAISS_MIN_WINDOWS`, the added items' on the file backend.

    ``vectors`` (W, d) and ``spans`` (W, 3) as the bundle stores them (the first column says whose window it
    is, windows of one recording adjacent in time order); ``keys``: the :data:`index.moments.sources.Key` of each
    recording in storage order (default: the first column, a bundle's audio-index rows)."""

    def __init__(self, vectors: np.ndarray, spans: np.ndarray, keys: Sequence[Key] | None = None) -> None:
        if vectors.ndim != 2 or spans.shape != (len(vectors), 3):
            raise BundleError(f"moment windows: {vectors.shape} vectors do not match {spans.shape} spans")
        self.vectors = vectors
        self.rows = spans[:, 0].astype(np.int64)
        self.spans = spans[:, 1:]
        starts = np.flatnonzero(np.diff(self.rows, prepend=-1)) if len(self.rows) else np.zeros(0, dtype=np.int64)
        self._starts = starts
        self._stops = np.append(starts[1:], len(self.rows)).astype(np.int64)
        self.keys: list[Key] = [int(r) for r in self.rows[starts]] if keys is None else list(keys)
        if len(self.keys) != len(starts):
            raise BundleError(f"moment windows: {len(self.keys)} keys for {len(starts)} recordings")
        self._position = {key: i for i, key in enumerate(self.keys)}

    @classmethod
    def load(cls, root: Path) -> ExactWindows:
        return cls(np.load(root / WINDOWS_FILE, allow_pickle=False), np.load(root / SPANS_FILE, allow_pickle=False))

    @classmethod
    def of_recordings(cls, recordings: Sequence[tuple[Key, np.ndarray, np.ndarray]], dim: int) -> ExactWindows:
        """The windows of ``(key, spans (m, 2), vectors (m, d))`` recordings (those without windows left out)."""
        kept = [(key, s, v) for key, s, v in recordings if len(s)]
        if not kept:
            return cls(np.zeros((0, dim), np.float32), np.zeros((0, 3)), [])
        table = np.concatenate([np.column_stack([np.full(len(s), i, np.float64), s])
                                for i, (_, s, _) in enumerate(kept)])
        vectors = np.concatenate([v for _, _, v in kept]).astype(np.float32, copy=False)
        return cls(vectors, table, [key for key, _, _ in kept])

    @property
    def n_recordings(self) -> int:
        return len(self._starts)

    @property
    def n_windows(self) -> int:
        return len(self.rows)

    def recording_rows(self) -> np.ndarray:
        """The catalogue rows that have windows, in storage order."""
        return self.rows[self._starts]

    def best_recordings(self, query: np.ndarray, n: int, allowed: Allowed | None = None) -> list[tuple[Key, float]]:
        """:meth:`index.moments.sources.WindowSource.best_recordings`: every window scored (one matrix-vector
        product), the recordings ranked by their best one; ``allowed`` asked about the best in order."""
        if not self.n_recordings or n <= 0:
            return []
        scores = self.vectors @ np.asarray(query, dtype=np.float32).reshape(-1)
        best = np.maximum.reduceat(scores, self._starts)
        order = np.argsort(-best, kind="stable")
        if allowed is None:
            return [(self.keys[r], float(best[r])) for r in order[:n]]
        found: list[tuple[Key, float]] = []
        step = max(n, ALLOWED_CHUNK)
        for first in range(0, len(order), step):
            chunk = order[first : first + step]
            ok = np.asarray(allowed([self.keys[r] for r in chunk]), dtype=bool)
            found.extend((self.keys[r], float(best[r])) for r in chunk[ok])
            if len(found) >= n:
                break
        return found[:n]

    def windows_of(self, keys: Sequence[Key]) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`index.moments.sources.WindowSource.windows_of` (a key it does not hold: no windows)."""
        out = []
        for key in keys:
            r = self._position.get(key)
            if r is None:
                out.append((np.zeros((0, 2)), np.zeros((0, self.vectors.shape[1]), np.float32)))
                continue
            a, b = self._starts[r], self._stops[r]
            out.append((self.spans[a:b], self.vectors[a:b]))
        return out

    def search(
        self, query: np.ndarray, k: int, *, allowed_rows: np.ndarray | None = None, min_score: float | None = None,
        params: MomentParams | None = None, head: MomentHeadModel | None = None,
    ) -> list[MomentHit]:
        """Top-``k`` moments of this source alone (:func:`index.moments.sources.search_sources`);
        ``allowed_rows``: a boolean mask over catalogue rows (keys that are rows)."""
        keep = None if allowed_rows is None else functools.partial(_rows_allowed, allowed_rows)
        hits = search_sources(query, k, [self], allowed=[keep], min_score=min_score, params=params, head=head)
        return [MomentHit(int(h.key), h.start, h.end, h.score) for h in hits]


WindowIndex = ExactWindows
"""The name before window sources (bench/moments_cost.py, older callers)."""


def _rows_allowed(mask: np.ndarray, keys: Sequence[Key]) -> np.ndarray:
    """The keys (catalogue rows) that ``mask`` allows; a row past its end is not."""
    rows = np.asarray(keys, dtype=np.int64)
    ok = rows < len(mask)
    ok[ok] = mask[rows[ok]]
    return ok


def write_bundle_windows(
    staging: Path, recordings: Sequence[tuple[int, np.ndarray, np.ndarray]], *, sample_rate: int, window_samples: int,
) -> MomentsInfo:
    """Write the windows into a bundle being staged; the manifest's ``moments`` entry."""
    n_windows, n_recordings = write_windows(staging, recordings)
    hop = max(1, int(round(window_samples * HOP_FRACTION)))
    return MomentsInfo(windows_file=WINDOWS_FILE, spans_file=SPANS_FILE, window_seconds=window_samples / sample_rate,
                       hop_seconds=hop / sample_rate, n_windows=n_windows, n_recordings=n_recordings)

