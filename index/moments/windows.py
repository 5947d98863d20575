"""Window embeddings of long recordings and the moment search over them (SPEC §19, docs/bundle.md "Moments").

A recording longer than the model's window (the bundle's ``clip_seconds``) is embedded as windows
of that length every ``hop`` seconds (:func:`index.moments.postprocess.window_spans`: the last window ends at
the recording's end), each window the model's own input length, so no padding is involved. The
bundle stores them beside its clip index:

* ``moments/windows.npy`` — ``(W, d)`` float32, L2-normalized, grouped by recording in time order;
* ``moments/spans.npy`` — ``(W, 3)`` float64: the recording's row in ``audio_ids.jsonl``, start, end.

Search is exact (one matrix-vector product over every window: ~W·d multiply-adds, 7,200 windows for
10 h of audio at a 5-s hop), so it does not depend on the clip index's backend (FAISS or Milvus).
The best moment of a recording scores its best window, so the top ``k`` moments come from the ``k``
recordings whose best window scores highest; only those are post-processed
(:func:`index.moments.postprocess.moments_from_scores`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from index.bundle.format import MomentsInfo
from index.errors import BundleError
from index.moments.postprocess import MomentParams, moments_from_scores, window_spans

WINDOWS_FILE = "moments/windows.npy"
SPANS_FILE = "moments/spans.npy"
HOP_FRACTION = 0.5
"""Windows overlap by half: the hop is half the model's window."""
LONG_RECORDING_WINDOWS = 2
"""A recording is *long* (indexed as windows) when it lasts more than this many windows; a shorter
one is found by its clip vector, and is at most two windows long anyway."""
ENCODE_BATCH = 16


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


class WindowIndex:
    """The bundle's windows, searched exactly (module docstring)."""

    def __init__(self, vectors: np.ndarray, spans: np.ndarray) -> None:
        if vectors.ndim != 2 or spans.shape != (len(vectors), 3):
            raise BundleError(f"moment windows: {vectors.shape} vectors do not match {spans.shape} spans")
        self.vectors = vectors
        self.rows = spans[:, 0].astype(np.int64)
        self.spans = spans[:, 1:]
        starts = np.flatnonzero(np.diff(self.rows, prepend=-1)) if len(self.rows) else np.zeros(0, dtype=np.int64)
        self._starts = starts
        self._stops = np.append(starts[1:], len(self.rows)).astype(np.int64)

    @classmethod
    def load(cls, root: Path) -> WindowIndex:
        return cls(np.load(root / WINDOWS_FILE, allow_pickle=False), np.load(root / SPANS_FILE, allow_pickle=False))

    @property
    def n_recordings(self) -> int:
        return len(self._starts)

    def recording_rows(self) -> np.ndarray:
        """The catalogue rows that have windows, in storage order."""
        return self.rows[self._starts]

    def search(
        self, query: np.ndarray, k: int, *, allowed_rows: np.ndarray | None = None, min_score: float | None = None,
        params: MomentParams | None = None,
    ) -> list[MomentHit]:
        """Top-``k`` moments for one query vector; ``allowed_rows``: a boolean mask over catalogue rows."""
        if not self.n_recordings:
            return []
        scores = self.vectors @ np.asarray(query, dtype=np.float32).reshape(-1)
        best = np.maximum.reduceat(scores, self._starts)
        rows = self.recording_rows()
        if allowed_rows is not None:
            inside = rows < len(allowed_rows)
            ok = np.zeros(len(rows), dtype=bool)
            ok[inside] = allowed_rows[rows[inside]]
            best = np.where(ok, best, -np.inf)
        order = np.argsort(-best, kind="stable")[:k]
        hits: list[MomentHit] = []
        for r in order:
            if not np.isfinite(best[r]) or (min_score is not None and best[r] < min_score):
                continue
            a, b = self._starts[r], self._stops[r]
            for moment in moments_from_scores(self.spans[a:b], scores[a:b], params):
                if min_score is None or moment.score >= min_score:
                    hits.append(MomentHit(int(rows[r]), moment.start, moment.end, moment.score))
        hits.sort(key=lambda h: (-h.score, h.row, h.start))
        return hits[:k]




def index_recordings(
    paths: Sequence[Path], *, sample_rate: int, window_samples: int,
    decode: Callable[[Path, int], np.ndarray], encode: Callable[[Sequence[np.ndarray]], np.ndarray],
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``(row, spans, vectors)`` of every long recording among ``paths`` (row i = paths[i]); the
    others are not decoded when their header tells their length."""
    hop = max(1, int(round(window_samples * HOP_FRACTION)))
    found = []
    for row, path in enumerate(paths):
        seconds = _header_seconds(path)
        if seconds is not None and seconds * sample_rate <= LONG_RECORDING_WINDOWS * window_samples:
            continue
        wave = decode(path, sample_rate)
        if wave.shape[0] > LONG_RECORDING_WINDOWS * window_samples:
            spans, vectors = embed_windows(wave, sample_rate=sample_rate, window_samples=window_samples,
                                           hop_samples=hop, encode=encode)
            found.append((row, spans, vectors))
    return found


def write_bundle_windows(
    staging: Path, recordings: Sequence[tuple[int, np.ndarray, np.ndarray]], *, sample_rate: int, window_samples: int,
) -> MomentsInfo:
    """Write the windows into a bundle being staged; the manifest's ``moments`` entry."""
    n_windows, n_recordings = write_windows(staging, recordings)
    hop = max(1, int(round(window_samples * HOP_FRACTION)))
    return MomentsInfo(windows_file=WINDOWS_FILE, spans_file=SPANS_FILE, window_seconds=window_samples / sample_rate,
                       hop_seconds=hop / sample_rate, n_windows=n_windows, n_recordings=n_recordings)


def _header_seconds(path: Path) -> float | None:
    """The duration a file's header declares (None: unknown, decode it to know)."""
    import soundfile as sf

    try:
        info = sf.info(str(path))
    except Exception:  # noqa: BLE001 - not readable by libsndfile: the decoder says why
        return None
    return float(info.frames) / info.samplerate if info.frames > 0 and info.samplerate > 0 else None

