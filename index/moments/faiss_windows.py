"""A bundle's moment windows behind an ANN index, memory-mapped (docs/bundle.md "Moments").

Above :data:`FAISS_MIN_WINDOWS` windows (~70 h of recordings at the demo's 10-s window, 5-s hop) the exact
search of :class:`index.moments.windows.ExactWindows` stops paying: it holds every vector in memory (1.4 GB at
1,000 h, 720,000 windows of 512 floats) and scores all of them for each query. :class:`FaissWindows` instead

* opens ``moments/windows.npy`` memory-mapped (``np.load(mmap_mode="r")``): a replica's memory holds the rows
  it reads, which the kernel may drop, not the file;
* finds candidate windows through an IVF-PQ inner-product index (:func:`build_index`: ~64 bytes a window, 46 MB
  at 1,000 h), re-scores them exactly from the mapped rows and ranks their recordings by their best
  candidate (:meth:`FaissWindows.best_recordings`);
* reads only the chosen recordings' rows (:meth:`FaissWindows.windows_of`), so the post-processing after it is
  bounded by the ``k`` recordings a query returns.

The index is derived data: bundles are immutable and checksummed, so it is not written into one. It is built
when the bundle is loaded and saved under a cache directory (the loader's: ``<bundles dir>/.moment-index``)
named by the windows file's checksum, so the next replica or restart reads it instead of building it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from index.errors import BundleError
from index.moments.sources import Allowed, Key
from index.moments.windows import SPANS_FILE, WINDOWS_FILE

log = logging.getLogger(__name__)
_faiss: Any = faiss  # the SWIG stubs miss SearchParameters' keyword arguments

FAISS_MIN_WINDOWS = 50_000
"""Windows from which a bundle's windows are searched through :class:`FaissWindows` (below it: exact, in memory;
50,000 windows of 512 floats are 100 MB and one exact query scores them in ~10 ms on one core)."""
MOMENT_INDEX_DIR = ".moment-index"
"""The loader's cache directory of these indexes, in the bundles directory (a dot name: never listed as a bundle)."""
CANDIDATES_PER_RECORDING = 16
"""Candidate windows asked of the index per recording a query wants (at least :data:`MIN_CANDIDATES`)."""
MIN_CANDIDATES = 1024
"""1,024 rows of 512 floats are 2 MB read from the mapped file a query; fewer lost the top moment of ~3 % of the
queries in tests/index/test_faiss_windows.py (a window the PQ codes ranked just below)."""
MAX_CANDIDATES = 1 << 16
"""The candidates grow ×4 until enough allowed recordings are found (a filter that passes few) or this cap; past
it the recordings the filter passes are ranked exactly (:meth:`FaissWindows._best_of_allowed`)."""
MAX_FILTERED_WINDOWS = 1 << 17
"""Most windows that exact ranking scans (~180 h of recordings, 256 MB read at d = 512; a filter that passes more
than that is found among the candidates first)."""
NPROBE = 32
"""Inverted lists an index search visits at least (of :func:`default_nlist`); more when the candidates asked
need them (twice the candidates' worth of lists)."""
TRAIN_SAMPLE = 65_536
"""Windows the index is trained on at most (a seeded sample; every window is added)."""
ADD_BLOCK = 65_536
"""Windows read from the mapped file and added to the index at a time."""


def default_nlist(n: int) -> int:
    """Inverted lists for ``n`` windows: ~256 windows a list, between 16 and 1,024."""
    return int(np.clip(n // 256, 16, 1024))


def subquantizers(dim: int) -> int:
    """PQ sub-vectors for ``dim``: 8 dimensions each (64 bytes a 512-d window), or the largest divisor of ``dim``
    up to ``dim // 8`` (at least 1)."""
    for m in range(max(1, dim // 8), 0, -1):
        if dim % m == 0:
            return m
    return 1


def build_index(vectors: np.ndarray, *, nlist: int | None = None, seed: int = 0) -> faiss.Index:
    """An IVF-PQ inner-product index over ``vectors`` (``(W, d)`` float32, L2-normalized; a memory-mapped array is
    read by blocks of :data:`ADD_BLOCK`)."""
    n, dim = vectors.shape
    if n == 0:
        raise BundleError("moment windows: no window to index")
    nlist = max(1, min(default_nlist(n) if nlist is None else nlist, n // 39))  # k-means: ≥ 39 points a list
    bits = min(8, max(1, int(np.log2(n))))  # a PQ code's 2^bits centroids need as many points (8 from 256 windows)
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFPQ(quantizer, dim, nlist, subquantizers(dim), bits, faiss.METRIC_INNER_PRODUCT)
    sample = np.sort(np.random.default_rng(seed).choice(n, size=min(n, TRAIN_SAMPLE), replace=False))
    index.train(np.ascontiguousarray(vectors[sample], dtype=np.float32))
    for first in range(0, n, ADD_BLOCK):
        index.add(np.ascontiguousarray(vectors[first : first + ADD_BLOCK], dtype=np.float32))
    return index


class FaissWindows:
    """A bundle's windows, memory-mapped, behind an IVF-PQ index (module docstring) — the
    :class:`index.moments.sources.WindowSource` of a large bundle; keys are audio-index rows.

    ``FaissWindows(root)`` opens the bundle (or any folder) at ``root`` that holds ``moments/windows.npy`` and
    ``moments/spans.npy`` and builds the index in memory; with ``cache_dir`` the index is read from there when
    saved before under ``key`` (default: a digest of the spans file and the windows file's size) and saved there
    once built. ``build_seconds``: how long the build took (0 when read)."""

    def __init__(self, root: Path, *, cache_dir: Path | None = None, key: str | None = None,
                 nprobe: int = NPROBE) -> None:
        root = Path(root)
        self.vectors = np.load(root / WINDOWS_FILE, mmap_mode="r", allow_pickle=False)
        self.spans = np.load(root / SPANS_FILE, mmap_mode="r", allow_pickle=False)
        if self.vectors.ndim != 2 or self.spans.shape != (len(self.vectors), 3):
            raise BundleError(f"moment windows: {self.vectors.shape} vectors do not match {self.spans.shape} spans")
        rows = np.asarray(self.spans[:, 0]).astype(np.int64)  # read once; only the per-recording starts stay
        self._starts = np.flatnonzero(np.diff(rows, prepend=-1)) if len(rows) else np.zeros(0, np.int64)
        self._stops = np.append(self._starts[1:], len(rows)).astype(np.int64)
        self._rows = rows[self._starts]
        self._position = {int(r): i for i, r in enumerate(self._rows.tolist())}
        del rows
        self.nprobe = nprobe
        self.build_seconds = 0.0
        self.index = self._open_index(root, cache_dir, key)
        self._ivf: Any = faiss.extract_index_ivf(self.index)  # its nlist

    @property
    def n_windows(self) -> int:
        return len(self.vectors)

    @property
    def n_recordings(self) -> int:
        return len(self._starts)

    def _open_index(self, root: Path, cache_dir: Path | None, key: str | None) -> faiss.Index:
        path = None
        if cache_dir is not None:
            path = Path(cache_dir) / f"{key or self._digest(root)}.faiss"
            if path.is_file():
                try:
                    index = faiss.read_index(str(path))
                    if index.ntotal == self.n_windows and index.d == self.vectors.shape[1]:
                        return index
                except RuntimeError as err:
                    log.warning("moment index %s unreadable (%s): building it again", path, err)
        started = time.perf_counter()
        index = build_index(self.vectors)
        self.build_seconds = time.perf_counter() - started
        log.info("moment windows: IVF-PQ index over %d windows built in %.1f s", self.n_windows, self.build_seconds)
        if path is not None:
            _save(index, path)
        return index

    def _digest(self, root: Path) -> str:
        """What names the index when the caller gives no key: the spans (which recordings, which seconds) and the
        vectors file's size — a bundle's windows never change under its path; another bundle's differ."""
        spans = np.ascontiguousarray(self.spans)
        digest = hashlib.sha256(spans.tobytes()).hexdigest()[:16]
        return f"{digest}-{(root / WINDOWS_FILE).stat().st_size}"

    def best_recordings(self, query: np.ndarray, n: int, allowed: Allowed | None = None) -> list[tuple[Key, float]]:
        """:meth:`index.moments.sources.WindowSource.best_recordings`: the index's top-M windows (M =
        :data:`CANDIDATES_PER_RECORDING` · ``n``, growing ×4 up to :data:`MAX_CANDIDATES` while too few allowed
        recordings are among them) re-scored exactly from the mapped rows; each recording ranked by its best. A
        filter that still leaves fewer than ``n``: the recordings it passes ranked exactly."""
        if not self.n_recordings or n <= 0:
            return []
        q = np.ascontiguousarray(np.asarray(query, dtype=np.float32).reshape(1, -1))
        verdict: dict[int, bool] = {}
        wanted = max(MIN_CANDIDATES, CANDIDATES_PER_RECORDING * n)
        while True:
            m = min(wanted, self.n_windows)
            per_list = max(1, self._ivf.ntotal // self._ivf.nlist)  # enough lists for twice the candidates asked
            nprobe = min(self._ivf.nlist, max(self.nprobe, -(-2 * m // per_list)))
            _, found = self.index.search(q, m, params=_faiss.SearchParametersIVF(nprobe=nprobe))  # per call: no lock
            ids = np.unique(found[0][found[0] >= 0])  # sorted: the mapped file read in order
            scores = np.asarray(self.vectors[ids], dtype=np.float32) @ q[0]
            recordings = np.searchsorted(self._starts, ids, side="right") - 1
            order = np.lexsort((-scores, recordings))  # by recording, best window first
            first = order[np.flatnonzero(np.diff(recordings[order], prepend=-1))]
            ranked = first[np.argsort(-scores[first], kind="stable")]
            best = [(int(self._rows[recordings[i]]), float(scores[i])) for i in ranked]
            if allowed is not None:
                unknown = [row for row, _ in best if row not in verdict]
                if unknown:
                    verdict.update(zip(unknown, np.asarray(allowed(unknown), dtype=bool).tolist(), strict=True))
                best = [(row, score) for row, score in best if verdict[row]]
            if len(best) >= n or m >= self.n_windows:
                return list(best[:n])
            if wanted >= MAX_CANDIDATES:  # a filter that passes few recordings: rank the ones it passes exactly
                return self._best_of_allowed(q[0], n, allowed, verdict) if allowed is not None else list(best[:n])
            wanted *= 4

    def _best_of_allowed(self, query: np.ndarray, n: int, allowed: Allowed, verdict: dict[int, bool]
                         ) -> list[tuple[Key, float]]:
        """The ``n`` best recordings among those ``allowed`` passes, by an exact scan of their windows (read from the
        mapped file): what a selective filter costs once the candidates reached :data:`MAX_CANDIDATES` — at most
        :data:`MAX_FILTERED_WINDOWS` windows are scanned, the best passing recordings' first."""
        rows = self._rows.tolist()
        unknown = [row for row in rows if row not in verdict]
        for first in range(0, len(unknown), ADD_BLOCK):
            chunk = unknown[first : first + ADD_BLOCK]
            verdict.update(zip(chunk, np.asarray(allowed(chunk), dtype=bool).tolist(), strict=True))
        best: list[tuple[Key, float]] = []
        scanned = 0
        for r in np.flatnonzero([verdict[row] for row in rows]).tolist():
            a, b = int(self._starts[r]), int(self._stops[r])
            if scanned + (b - a) > MAX_FILTERED_WINDOWS:
                log.warning("moment search: the filter passes recordings of more than %d windows; the ones past it are "
                            "not ranked", MAX_FILTERED_WINDOWS)
                break
            scanned += b - a
            best.append((rows[r], float(np.max(np.asarray(self.vectors[a:b], np.float32) @ query))))
        best.sort(key=lambda found: -found[1])
        return best[:n]

    def windows_of(self, keys: Sequence[Key]) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`index.moments.sources.WindowSource.windows_of`: only these recordings' rows are read."""
        out = []
        for key in keys:
            r = self._position.get(int(key))
            if r is None:
                out.append((np.zeros((0, 2)), np.zeros((0, self.vectors.shape[1]), np.float32)))
                continue
            a, b = int(self._starts[r]), int(self._stops[r])
            out.append((np.asarray(self.spans[a:b, 1:], dtype=np.float64), np.asarray(self.vectors[a:b], np.float32)))
        return out


def _save(index: faiss.Index, path: Path) -> None:
    """Write the index beside its final name and rename it there (replicas building at once each write a whole
    file); a volume that refuses costs a build at the next load, not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".faiss")
        os.close(fd)
        try:
            faiss.write_index(index, tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except (OSError, RuntimeError) as err:
        log.warning("moment index not saved to %s (%s): the next load builds it again", path, err)
