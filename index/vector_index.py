"""The backend interface of the index layer, and its FAISS implementation (the bundle's own files).

Layering (docs/ARCHITECTURE.md): bundle format (:mod:`index.bundle`) → backends (this module,
:mod:`index.faiss_index`, :mod:`index.milvus_index`) → loader (:mod:`index.loader`). A backend
implements :class:`VectorIndex` — ``search(queries, k, languages)`` and ``vectors()`` — and
never imports the loader.

Per-language caption search (FAISS): the caption rows of ``text.faiss`` are stored grouped by
language (``manifest.text_index.language_ranges``), so a language filter is an
``IDSelectorRange`` (or an ``IDSelectorOr`` of several) passed in a fresh per-call
``SearchParameters`` — never by changing the shared index.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import faiss
import numpy as np

from index.bundle import IndexInfo
from index.errors import BundleError
from index.faiss_index import all_vectors, load_index, parse_factory, search


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

    def search(
        self, queries: np.ndarray, k: int, languages: Sequence[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
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

    def vectors(self) -> np.ndarray:
        return all_vectors(self.index)


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
