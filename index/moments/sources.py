"""Where moment windows come from, and the one moment search over them (SPEC §19, docs/ARCHITECTURE.md
"Moment query flow").

A *window source* holds the windows of some long recordings — the bundle's (:class:`index.moments.windows.
ExactWindows` in memory, :class:`index.moments.faiss_windows.FaissWindows` memory-mapped behind an ANN index,
``index.engines.milvus_windows.MilvusWindows`` in Milvus) or the added items' — each recording named by a
:data:`Key`: its audio-index row for a bundle recording, its id for an added item.

:func:`search_sources` asks every source for its ``k`` recordings whose best window scores highest, keeps
the ``k`` best of them all, reads only *their* windows and post-processes each one (the trained head, or
the sliding-window scorer): the work after the candidate search is bounded by ``k`` recordings, whatever
the number of recordings the sources hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from index.moments.head import MomentHeadModel
from index.moments.postprocess import MomentParams, moments_from_scores

Key = int | str
"""A recording of a source: a bundle recording's audio-index row (int), an added item's id (str)."""

Allowed = Callable[[Sequence[Key]], np.ndarray]
"""Which of some keys a search may return: a boolean array, one per key (a filter, the live items, the
clips no added item hides)."""


class WindowSource(Protocol):
    """The windows of some long recordings (module docstring)."""

    def best_recordings(self, query: np.ndarray, n: int, allowed: Allowed | None = None) -> list[tuple[Key, float]]:
        """Up to ``n`` recordings whose best window scores highest for the ``(d,)`` query, best first, each
        with that best window's cosine; only keys for which ``allowed(keys)`` is True. An ANN source searches
        its top-M windows (M grows until ``n`` allowed recordings are found or a cap is reached): it reads
        candidates, never every window."""
        ...

    def windows_of(self, keys: Sequence[Key]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each key's windows in time order: ``(spans (m, 2) seconds, vectors (m, d) float32 L2-normalized)``."""
        ...


@dataclass(frozen=True)
class SourceHit:
    """A moment of recording ``key`` of ``sources[source]``: seconds from its start, and its score (the
    cosine of its best window, or the head's relevance probability)."""

    source: int
    key: Key
    start: float
    end: float
    score: float


READ_CHUNK = 8
"""Recordings read and post-processed at a time, best first: with the sliding-window scorer the reading stops
once ``k`` moments score above the next recording's best window (a recording yields several moments)."""


FLOOR_MARGIN = 0.01
"""How far under the k-th candidate recording's best window a run may peak and still be post-processed: an ANN
source's candidate scores are its index's (Milvus's float32 against the float16 windows read back: ~1e-3)."""


def _kth_score(hits: Sequence[SourceHit], k: int) -> float:
    return sorted((h.score for h in hits), reverse=True)[k - 1]


def _key_order(key: Key) -> tuple[bool, int | str]:
    """Ties broken by key: rows before ids, rows by number, ids by name (a stable, comparable order)."""
    return (isinstance(key, str), key)


def search_sources(
    query: np.ndarray, k: int, sources: Sequence[WindowSource], *, allowed: Sequence[Allowed | None] | None = None,
    min_score: float | None = None, params: MomentParams | None = None, head: MomentHeadModel | None = None,
) -> list[SourceHit]:
    """Top-``k`` moments over ``sources`` for one query vector, best first; ``allowed``: one filter per source
    (None: all its recordings).

    The best moment of a recording scores its best window (:func:`index.moments.postprocess.
    moments_from_scores`), so the top ``k`` moments come from the ``k`` recordings whose best window scores
    highest over all sources; only those are read and post-processed, best first, and with the sliding-window
    scorer only until ``k`` moments score above the next one's best window. Their moments come from ``head``
    (the bundle's trained moment head: scores are its relevance probabilities, ``min_score`` applies to
    them) or, without one, from the sliding-window scorer (cosines; a recording whose best window scores
    under ``min_score`` has no moment that passes, so it is not read)."""
    if k <= 0 or not sources:
        return []
    q = np.asarray(query, dtype=np.float32).reshape(-1)
    filters = list(allowed) if allowed is not None else [None] * len(sources)
    candidates: list[tuple[float, int, Key]] = []
    for index, (source, keep) in enumerate(zip(sources, filters, strict=True)):
        for key, best in source.best_recordings(q, k, keep):
            if np.isfinite(best) and (head is not None or min_score is None or best >= min_score):
                candidates.append((float(best), index, key))
    candidates.sort(key=lambda c: (-c[0], c[1], _key_order(c[2])))
    candidates = candidates[:k]
    # the k recordings each give a moment scoring their best window: a run of windows under the k-th best
    # cannot rank (FLOOR_MARGIN: a source's candidate score may be its index's, a hair off the windows' own)
    floor = candidates[-1][0] - FLOOR_MARGIN if head is None and len(candidates) == k else None
    if min_score is not None and head is None:
        floor = min_score if floor is None else max(floor, min_score)
    hits: list[SourceHit] = []
    for first in range(0, len(candidates), READ_CHUNK):
        if head is None and len(hits) >= k and candidates[first][0] < _kth_score(hits, k):
            break  # no moment of a later recording can score above its best window: the top k are known
        chunk = candidates[first : first + READ_CHUNK]
        for index, source in enumerate(sources):
            keys = [key for _, i, key in chunk if i == index]
            if not keys:
                continue
            for key, (spans, vectors) in zip(keys, source.windows_of(keys), strict=True):
                if not len(spans):
                    continue
                found = (moments_from_scores(spans, vectors @ q, params, floor=floor) if head is None
                         else head.moments(spans, vectors, q))
                hits.extend(SourceHit(index, key, m.start, m.end, m.score) for m in found
                            if min_score is None or m.score >= min_score)
    hits.sort(key=lambda h: (-h.score, h.source, _key_order(h.key), h.start))
    return hits[:k]
