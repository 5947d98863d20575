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
from typing import Protocol, runtime_checkable

import numpy as np

from index.moments.head import MomentHeadModel
from index.moments.postprocess import (
    Moment,
    MomentParams,
    background_of,
    moments_from_scores,
    non_maximum_suppression,
)

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
class Stretch:
    """Consecutive windows of a recording: the position of the first in the recording's time order, and
    ``spans`` (m, 2) seconds and ``vectors`` (m, d) as :meth:`WindowSource.windows_of` gives them."""

    first: int
    spans: np.ndarray
    vectors: np.ndarray

    @property
    def stop(self) -> int:
        return self.first + len(self.spans)


@dataclass(frozen=True)
class Excerpt:
    """Some of a recording's windows, read instead of all of them (:class:`ExcerptSource`)."""

    n_windows: int
    """How many windows the recording has."""
    sample: Stretch
    """Windows spread evenly over the whole recording (every s-th; ``first`` is meaningless): what its
    background level is read from (:func:`index.moments.postprocess.background_level`)."""
    stretches: list[Stretch]
    """The ranges asked for, clipped to the recording, merged where they touch; in time order."""


@dataclass(frozen=True)
class HotWindows:
    """The windows of a candidate recording that a source's candidate search returned (positions and scores),
    and the score above which it returned every window of that recording (``-inf``: every window)."""

    seqs: list[int]
    scores: list[float]
    complete_above: float


@runtime_checkable
class ExcerptSource(WindowSource, Protocol):
    """A window source whose reads cost by the window (Milvus: they cross the network): the moment search reads
    stretches around a recording's best windows and a sample for its background, not the whole recording
    (:func:`search_sources`, "bounded reads")."""

    def best_recordings_hot(self, query: np.ndarray, n: int, allowed: Allowed | None = None
                            ) -> tuple[list[tuple[Key, float]], dict[Key, HotWindows]]:
        """:meth:`WindowSource.best_recordings` and, per recording returned, the windows its search saw (a
        recording whose hot windows are known from there needs no :meth:`hot_windows` search)."""
        ...

    def hot_windows(self, query: np.ndarray, keys: Sequence[Key], floor: float) -> list[list[int]]:
        """For each key, the positions of its windows scoring at least ``floor`` for ``query`` — its best window
        at least — as far as one search finds them (a stretch that turns out to need more is read on)."""
        ...

    def excerpts(self, wanted: Sequence[tuple[Key, Sequence[tuple[int, int]]]]) -> list[Excerpt | None]:
        """For each ``(key, [(first, stop), ...])`` those windows and the key's sample; None for a key written
        without a sample (read it whole with :meth:`WindowSource.windows_of`)."""
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


EXCERPT_RADIUS = 8
"""Windows read on each side of a hot window (:meth:`ExcerptSource.hot_windows`) at first: an event of up to 16
windows (40 s at the demo's hop) is read in one go; a run still active at a stretch's cut edge is read on."""
EXCERPT_ROUNDS = 4
"""Reads of more windows per query before a recording whose run keeps going is read whole (an event covering most
of a long recording)."""


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
    seen_hot: dict[tuple[int, Key], HotWindows] = {}
    for index, (source, keep) in enumerate(zip(sources, filters, strict=True)):
        if head is None and isinstance(source, ExcerptSource):
            best_of, hot_of = source.best_recordings_hot(q, k, keep)
            seen_hot.update(((index, key), hot) for key, hot in hot_of.items())
        else:
            best_of = source.best_recordings(q, k, keep)
        for key, best in best_of:
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
            if head is None and floor is not None and isinstance(source, ExcerptSource):
                known = {key: seen_hot[(index, key)] for key in keys if (index, key) in seen_hot}
                found_bounded, keys = _bounded_moments(source, q, keys, floor, params or MomentParams(), known)
                hits.extend(SourceHit(index, key, m.start, m.end, m.score) for key, found in found_bounded.items()
                            for m in found if min_score is None or m.score >= min_score)
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


def _bounded_moments(source: ExcerptSource, query: np.ndarray, keys: list[Key], floor: float, params: MomentParams,
                     known: dict[Key, HotWindows]) -> tuple[dict[Key, list[Moment]], list[Key]]:
    """The moments scoring at least ``floor`` of ``keys``' recordings from stretches around their hot windows
    (:data:`EXCERPT_RADIUS` each side) and a sample for the background; the keys to read whole instead (no
    sample, or still growing after :data:`EXCERPT_ROUNDS`).

    Within a stretch the post-processing is the whole recording's as long as the stretch's cut edges hold
    no active window (one at or above the merge level, ``b + merge_ratio · (P − b)``): a run cannot cross
    such an edge, and refinement never walks past a run's ends into windows below the merge level. A stretch
    whose cut edge is active is read on, twice as far, and processed again. What differs from reading the
    whole recording: the background comes from the sample (a quantile and medians of ~40–90 windows spread
    over it instead of all of them) — edges move by a fraction of what the background's error moves the edge
    level — and a hot window the source's search did not return (bench/moments_scale.py measures the top
    moment against the exact source). ``known``: keys whose hot windows the candidate search returned; those it
    returned every window at ``floor`` or more of (up to :data:`FLOOR_MARGIN`) need no search of their own."""
    hot: dict[Key, list[int]] = {}
    for key, seen in known.items():
        if seen.complete_above <= floor + FLOOR_MARGIN:
            hot[key] = [seq for i, (seq, score) in enumerate(zip(seen.seqs, seen.scores, strict=True))
                        if score >= floor or i == 0]
    unknown = [key for key in keys if key not in hot]
    if unknown:
        hot.update(zip(unknown, source.hot_windows(query, unknown, floor), strict=True))
    ranges = {key: [(max(0, s - EXCERPT_RADIUS), s + EXCERPT_RADIUS + 1) for s in hot[key]]
              for key in keys if hot.get(key)}
    whole = [key for key in keys if key not in ranges]
    found: dict[Key, list[Moment]] = {}
    for _ in range(EXCERPT_ROUNDS):
        if not ranges:
            break
        asked = list(ranges.items())
        more: dict[Key, list[tuple[int, int]]] = {}
        for (key, wanted), excerpt in zip(asked, source.excerpts(asked), strict=True):
            if excerpt is None or not excerpt.stretches:
                whole.append(key)
                continue
            moments, grow = _excerpt_moments(excerpt, query, floor, params)
            if grow:
                more[key] = [*wanted, *grow]
            else:
                found[key] = moments
        ranges = more
    whole.extend(ranges)
    return found, whole


def _excerpt_moments(excerpt: Excerpt, query: np.ndarray, floor: float, params: MomentParams
                     ) -> tuple[list[Moment], list[tuple[int, int]]]:
    """The moments of one excerpt, or the ranges to read on: a cut edge (one that is not the recording's) is read
    past when the run of active windows reaching it peaks at ``floor`` or more inside the stretch, or a moment that
    ranks has its edge there (refinement walked off the stretch). A run reaching a cut edge that peaks lower there
    matters only if it rises to ``floor`` outside, where that window is hot and its own stretch grows towards this
    one."""
    background = background_of(excerpt.sample.vectors @ query, params)
    curves = [np.asarray(s.vectors @ query, np.float64) for s in excerpt.stretches]
    top = max(float(c.max()) for c in curves)
    active_level = background + params.merge_ratio * (top - background)
    grow: list[tuple[int, int]] = []
    moments: list[Moment] = []
    for stretch, scores in zip(excerpt.stretches, curves, strict=True):
        found = moments_from_scores(stretch.spans, scores, params, floor=floor, background=background, top=top)
        moments.extend(found)
        reach = max(2 * EXCERPT_RADIUS, len(scores))
        inactive = np.flatnonzero(scores < active_level)
        left_run = scores[: inactive[0] if len(inactive) else len(scores)]
        right_run = scores[inactive[-1] + 1 if len(inactive) else 0 :]
        at_start = any(m.start <= stretch.spans[0, 0] for m in found)
        at_end = any(m.end >= stretch.spans[-1, 1] for m in found)
        if stretch.first > 0 and (at_start or (len(left_run) and left_run.max() >= floor)):
            grow.append((max(0, stretch.first - reach), stretch.first))
        if stretch.stop < excerpt.n_windows and (at_end or (len(right_run) and right_run.max() >= floor)):
            grow.append((stretch.stop, stretch.stop + reach))
    if grow:
        return [], grow
    return non_maximum_suppression(moments, params.nms_iou, params.max_moments), []
