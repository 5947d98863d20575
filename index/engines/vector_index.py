"""The backend interface of the index layer, and its FAISS implementation (the bundle's own files).

Layering (docs/ARCHITECTURE.md): bundle format (:mod:`index.bundle.format`) → backends (this module,
:mod:`index.engines.faiss_index`, :mod:`index.engines.milvus_index`) → loader (:mod:`index.runtime.loader`). A backend
implements :class:`VectorIndex` — ``search(queries, k, languages)`` and ``vectors()`` — and
never imports the loader.

Per-language caption search (FAISS): the caption rows of ``text.faiss`` are stored grouped by
language (``manifest.text_index.language_ranges``), so a language filter is an
``IDSelectorRange`` (or an ``IDSelectorOr`` of several) passed in a fresh per-call
``SearchParameters`` — never by changing the shared index.

Metadata-filtered search (:mod:`index.engines.filters` makes the mask): ``allowed`` is a boolean mask over
the rows. When few rows pass (at most :data:`PREFILTER_FRACTION` of them, or at most
:data:`PREFILTER_ROWS`) the search runs with an ``IDSelectorBitmap`` (IVF: over every list, so
the rows that pass are all scanned — or, on an IVF index with at most :data:`EXACT_SUBSET_ROWS`
passing rows, their vectors are read back by id and ranked exactly: a scan of every list costs
~40 ms at 1 M rows on disk, reading back a few hundred rows well under 1 ms); otherwise it over-fetches ``k / fraction`` hits (× 2) and
drops the rows that fail, doubling until ``k`` pass or the whole index was fetched. Either way a
``Flat`` index returns exactly the brute-force top-k over the passing rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import faiss
import numpy as np

from index.bundle.format import IndexInfo
from index.engines.faiss_index import all_vectors, load_index, parse_factory, search
from index.errors import BundleError

_faiss: Any = faiss  # the SWIG stubs miss the array form of IDSelectorBitmap

PREFILTER_FRACTION = 0.05
"""Filters passing at most this share of the rows search with an ID selector (pre-filter)."""
PREFILTER_ROWS = 2048
"""…and so do filters passing at most this many rows, whatever their share."""
OVERFETCH = 2.0
EXACT_SUBSET_ROWS = 1024
"""An IVF pre-filter passing at most this many rows reads their vectors back (``reconstruct_batch``
through the direct map) and ranks them exactly instead of scanning every list. Measured on an
on-disk IVF512,SQfp16 of 200 k rows (AMD EPYC): 181 rows 0.15 ms against 5.7 ms for the scan, but
2,001 rows 16 ms (rows spread over every list: a read-back each) — hence the bound."""


class VectorIndex(Protocol):
    """The one small interface both backends implement (FAISS in the bundle, or Milvus)."""

    ntotal: int

    def search(
        self, queries: np.ndarray, k: int, languages: Sequence[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores (n, k) float32, rows (n, k) int64; -1 / -inf past the end), rows only
        of ``languages`` when given (the caption index)."""
        ...

    def vectors(self) -> np.ndarray:
        """Every stored vector, row order."""
        ...


class FaissVectorIndex:
    """A loaded FAISS index with its fixed search parameters; languages are row ranges."""

    def __init__(self, index: faiss.Index, params: dict[str, int], ranges: dict[str, tuple[int, int]] | None = None):
        self.index = index
        self.params = params
        self.ntotal = int(index.ntotal)
        self._selectors = {lang: faiss.IDSelectorRange(lo, hi) for lang, (lo, hi) in (ranges or {}).items()}
        self._ivf = faiss.try_extract_index_ivf(index)
        self._direct_map_lock = threading.Lock()
        self._direct_map_ready = False

    def search(
        self,
        queries: np.ndarray,
        k: int,
        languages: Sequence[str] | None = None,
        allowed: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        if allowed is not None:
            if languages:
                raise ValueError("a metadata filter applies to the clip index, not to per-language caption search")
            return self._search_allowed(queries, k, np.asarray(allowed, dtype=bool))
        if not languages:
            return search(self.index, queries, k, params=self.params)
        selectors = [self._selectors[lang] for lang in sorted(languages)]
        combined: faiss.IDSelector = selectors[0]
        keep_alive = [combined]  # the SWIG Or-selector does not own its parts
        for other in selectors[1:]:
            combined = faiss.IDSelectorOr(combined, other)
            keep_alive.append(combined)
        result = search(self.index, queries, k, params=self.params, selector=combined)
        del keep_alive
        return result

    def _search_allowed(self, queries: np.ndarray, k: int, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if allowed.shape != (self.ntotal,):
            raise ValueError(f"filter mask has shape {allowed.shape}; the index holds {self.ntotal} rows")
        passing = int(np.count_nonzero(allowed))
        n = int(np.asarray(queries).shape[0])
        if passing == 0:
            return np.full((n, k), -np.inf, np.float32), np.full((n, k), -1, np.int64)
        if passing <= PREFILTER_ROWS or passing <= PREFILTER_FRACTION * self.ntotal:
            return self._prefiltered(queries, k, allowed)
        return overfetch_search(lambda kk: search(self.index, queries, kk, params=self.params),
                                k, allowed, ntotal=self.ntotal)

    def _prefiltered(self, queries: np.ndarray, k: int, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._ivf is not None and np.count_nonzero(allowed) <= EXACT_SUBSET_ROWS:
            return exact_subset_search(_ReadBack(self), queries, k, allowed)
        bitmap = np.packbits(allowed, bitorder="little")
        selector = _faiss.IDSelectorBitmap(bitmap)  # the wrapper takes the array and keeps it alive
        params = dict(self.params)
        if "nprobe" in params:  # scan every list: the few passing rows may lie in any of them
            params["nprobe"] = int(faiss.extract_index_ivf(self.index).nlist)
        return search(self.index, queries, k, params=params, selector=selector)

    def vectors(self) -> np.ndarray:
        return all_vectors(self.index)

    def read_back(self, rows: np.ndarray) -> np.ndarray:
        """The stored (for SQ: decoded) vectors of ``rows``; an IVF index gets its direct map (8 bytes a
        row) on the first call. Searches never read the direct map, so building it beside them is safe."""
        if self._ivf is not None and not self._direct_map_ready:
            with self._direct_map_lock:  # the flag, not direct_map.type, which FAISS sets before filling it
                if not self._ivf.direct_map.type:
                    self._ivf.make_direct_map()
                self._direct_map_ready = True
        return np.asarray(self.index.reconstruct_batch(np.ascontiguousarray(rows, dtype=np.int64)), dtype=np.float32)


class _ReadBack:
    """``vectors[rows]`` for :func:`exact_subset_search`, read from the index by id."""

    def __init__(self, index: FaissVectorIndex) -> None:
        self._index = index

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        return self._index.read_back(rows)


def exact_subset_search(
    vectors: np.ndarray | _ReadBack, queries: np.ndarray, k: int, allowed: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-``k`` by inner product over the rows ``allowed`` passes (numpy; for few rows)."""
    rows = np.flatnonzero(allowed)
    n = int(np.asarray(queries).shape[0])
    out_scores = np.full((n, k), -np.inf, np.float32)
    out_rows = np.full((n, k), -1, np.int64)
    if rows.size == 0:
        return out_scores, out_rows
    scores = np.asarray(queries, dtype=np.float32) @ np.asarray(vectors[rows], dtype=np.float32).T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    out_scores[:, : order.shape[1]] = np.take_along_axis(scores, order, axis=1)
    out_rows[:, : order.shape[1]] = rows[order]
    return out_scores, out_rows


def overfetch_search(
    fetch: Callable[[int], tuple[np.ndarray, np.ndarray]], k: int, allowed: np.ndarray, *, ntotal: int
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` of the rows ``allowed`` passes from unfiltered searches ``fetch(kk)``: ``kk`` starts at
    ``k`` / (passing share) × :data:`OVERFETCH` and doubles until every query has ``k`` passing hits
    or the whole index was fetched (exact for an exact index: the best passing rows rank first)."""
    share = max(float(np.count_nonzero(allowed)) / max(ntotal, 1), 1e-12)
    kk = min(ntotal, max(k, int(np.ceil(k / share * OVERFETCH))))
    while True:
        scores, rows = fetch(kk)
        keep = (rows >= 0) & allowed[np.clip(rows, 0, None)]
        if kk >= ntotal or bool(np.all(keep.sum(axis=1) >= k)):
            break
        kk = min(ntotal, kk * 2)
    n = rows.shape[0]
    out_scores = np.full((n, k), -np.inf, np.float32)
    out_rows = np.full((n, k), -1, np.int64)
    for i in range(n):
        picked = np.flatnonzero(keep[i])[:k]
        out_scores[i, : picked.size] = scores[i, picked]
        out_rows[i, : picked.size] = rows[i, picked]
    return out_scores, out_rows


def open_faiss_index(root: Path, info: IndexInfo, *, embed_dim: int, mmap_threshold_bytes: int) -> FaissVectorIndex:
    spec = parse_factory(info.factory, info.dim)
    index = load_index(
        root / info.file, spec=spec, search_params=info.search_params, mmap_threshold_bytes=mmap_threshold_bytes
    )
    if index.d != embed_dim or info.dim != embed_dim:
        raise BundleError(f"{root / info.file}: dimension {index.d} != manifest embed_dim {embed_dim}")
    if index.ntotal != info.ntotal:
        raise BundleError(f"{root / info.file}: ntotal {index.ntotal} != {info.ntotal} in manifest")
    return FaissVectorIndex(index, dict(info.search_params), info.language_ranges)
