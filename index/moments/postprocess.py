"""From window scores to moments (SPEC §19): merge, refine, suppress — pure numpy, torch-free.

A long recording is indexed as windows of ``window`` seconds every ``hop`` seconds
(:func:`window_spans`); a query scores each window (cosine of the embeddings). The sliding-window
baseline of Munakata et al. (2024) turns that score curve into moments in three steps
(:func:`moments_from_scores`, docs/service.md "Moments"):

1. **Merge.** With ``b`` the recording's background (:func:`background_level`) and ``P`` its best
   window score, windows scoring at least ``b + merge_ratio · (P - b)`` are *active*; each run of
   adjacent active windows becomes one moment, scored by its best window ``p``.
2. **Refine.** The curve is read as piecewise linear through the window centres. A moment's
   boundaries are the outermost crossings of ``b + edge_level · (p - b)`` around its run — from
   each end of the run inward while a window is below that level, then outward while one is at or
   above it — interpolated between the two centres around the crossing, so a dip inside the run
   does not cut the moment short; a curve still above that level at either end of the recording
   stops at the recording's edge.
3. **Suppress.** Non-maximum suppression in score order drops a moment whose IoU with a kept one
   reaches ``nms_iou`` (refinement can make neighbouring runs overlap), then keeps at most
   ``max_moments``.

**Why the edge level is 0.65, not one half.** The window centred on an event's edge hears the
event over half its length. If a window's score grew in proportion to the share of the event it
hears, that window would score half the height and the half-height crossing would land on the
edge. It does not: a window scores nearly the full height once it hears about two thirds of an
event (the demo encoder on held-out clips laid on noise, as a share of the height: 0.19 with a
tenth to a fifth of the event heard, 0.55 with a third, 0.63 with 0.4-0.5, 0.80 with 0.5-0.6,
0.95 from 0.8 up). So the half-height crossing lands where a window hears only a third of the
event, outside the edge: at the service's hop (half a window) each edge came out a median 0.95 s
outside, and 4.5-s events in 5-s windows came out 6.1-6.4 s long. Read at 0.65, the edges come
out a median 0.3-0.4 s outside and such an event about one window long (5.2 s) — the windows
cannot tell where inside themselves a shorter sound lies. 0.65 was the best of 0.5-0.8 on two
development sets (``bench/moments_baseline.py`` at another seed than its own, and the
generator's own recordings of ``tonearm synth --moments``); ``edge_level=0.5`` restores the
half-height rule.

:data:`LEGACY_MOMENT_PARAMS` is the post-processing as it was before (median background,
half-height edges), kept to measure against (``bench/moments_baseline.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from index.metrics.moments import temporal_iou


class Moment(NamedTuple):
    """A span of a recording (seconds) and its score."""

    start: float
    end: float
    score: float


BACKGROUND_QUANTILE = 0.1
"""The low quantile of the window scores that stands in for the background while looking for an
event that covers most of the recording (:func:`background_level`): below any event that covers
less than 90 % of it."""

Background = Literal["non_event", "median"]


@dataclass(frozen=True)
class MomentParams:
    """Post-processing knobs; the defaults are the service's and the evaluator's."""

    merge_ratio: float = 0.5
    """Fraction of the way from the background to the best score a window must reach to be merged."""
    edge_level: float = 0.65
    """Fraction of the way from the background to a moment's peak where its edges are read (module
    docstring: why not one half)."""
    background: Background = "non_event"
    """``non_event``: :func:`background_level`; ``median``: the median of every window's score (before)."""
    nms_iou: float = 0.5
    """A moment overlapping a better one of the same recording by this IoU or more is dropped."""
    max_moments: int = 10
    """Moments kept per recording (the metrics' ``MAX_PREDICTIONS``)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.merge_ratio <= 1.0:
            raise ValueError(f"merge_ratio must lie in (0, 1], got {self.merge_ratio}")
        if not 0.0 < self.edge_level < 1.0:
            raise ValueError(f"edge_level must lie in (0, 1), got {self.edge_level}")
        if self.background not in ("non_event", "median"):
            raise ValueError(f"background must be 'non_event' or 'median', got {self.background!r}")
        if not 0.0 < self.nms_iou <= 1.0:
            raise ValueError(f"nms_iou must lie in (0, 1], got {self.nms_iou}")
        if self.max_moments < 1:
            raise ValueError(f"max_moments must be at least 1, got {self.max_moments}")


LEGACY_MOMENT_PARAMS = MomentParams(edge_level=0.5, background="median")
"""The post-processing before issue 54: the median as background, edges at half height."""


def window_spans(duration: float, window: float, hop: float) -> np.ndarray:
    """``(N, 2)`` spans of the windows that cover ``[0, duration]``: one every ``hop`` seconds, the
    last moved left to end at ``duration`` when the hops do not land there; a recording no longer
    than one window is one span of its own length."""
    if window <= 0 or hop <= 0 or hop > window:
        raise ValueError(f"need 0 < hop <= window, got window={window}, hop={hop}")
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    if duration <= window:
        return np.array([[0.0, float(duration)]])
    starts = np.arange(0.0, duration - window + 1e-9, hop)
    if starts[-1] + window < duration - 1e-9:
        starts = np.append(starts, duration - window)
    return np.stack([starts, starts + window], axis=1)


def _runs(active: np.ndarray) -> list[tuple[int, int]]:
    """``(first, last)`` index pairs of the runs of True in ``active``."""
    padded = np.concatenate([[False], active, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a), int(b) - 1) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _crossing(
    centres: np.ndarray, scores: np.ndarray, outer: int, peak: int, level: float, step: int
) -> int | float:
    """The outermost crossing of ``level`` on the ``step`` side (±1) of ``peak``: from the window
    ``outer`` (the run's end on that side), inward to the first window at or above ``level`` if it is
    below, then outward while the windows stay at or above it. The interpolated time, or the index
    ``-1``/``len`` when the curve is still above ``level`` at the recording's end. Dips below
    ``level`` inside the run do not cut the moment short."""
    i = outer
    while i != peak and scores[i] < level:
        i -= step
    while 0 <= i + step < len(scores) and scores[i + step] >= level:
        i += step
    j = i + step
    if not 0 <= j < len(scores):
        return j
    inside, outside = scores[i], scores[j]
    fraction = (inside - level) / (inside - outside)
    return float(centres[i] + fraction * (centres[j] - centres[i]))


def background_level(scores: np.ndarray, merge_ratio: float = 0.5) -> float:
    """The score of the recording's windows that hear none of the query's events.

    Usually the median of all its windows: events are short beside the recording, so most windows
    are background and the median is one of them. That fails when one event covers most of the
    recording (a concert, rain, an engine: 4-9 % of CASTELLA's test queries cover more than half
    their recording): the median is then a score *of the event*, the merge level sits inside the
    event's own ups and downs, and the event breaks into fragments or is not found at all. So the
    best window's run is looked for first against a level that is background in any case — the
    :data:`BACKGROUND_QUANTILE` (10 %) quantile: merged as in step 1 of the module docstring
    (``merge_ratio`` of the way from it to the best score). If that run covers more than half of
    the windows, the event is the majority: the background is the median of the windows outside
    the run (the quantile itself when there are none). Otherwise the median of all windows, as
    before, so a recording of short events is read as it always was.
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    best = int(np.argmax(scores))
    ordered = np.sort(scores)
    low = _sorted_quantile(ordered, BACKGROUND_QUANTILE)
    for first, last in _runs(scores >= low + merge_ratio * (float(scores[best]) - low)):
        if first <= best <= last:
            if 2 * (last - first + 1) > len(scores):
                outside = np.concatenate([scores[:first], scores[last + 1 :]])
                return _sorted_median(np.sort(outside)) if len(outside) else low
            break
    return _sorted_median(ordered)


# np.quantile / np.median cost ~70-130 us a call in numpy's generic machinery — two thirds of a recording's
# post-processing, which a moment query runs for up to k recordings. Over one sorted copy they are two
# lookups; the same values bit for bit (numpy's "linear" method and its lerp; tests/index/test_moments.py).


def _sorted_quantile(ordered: np.ndarray, q: float) -> float:
    """``np.quantile(x, q)`` (method "linear") of the values ``ordered`` (``np.sort(x)``, not empty)."""
    at = q * (len(ordered) - 1)
    lo = int(np.floor(at))
    hi = min(lo + 1, len(ordered) - 1)
    t = at - lo
    a, b = float(ordered[lo]), float(ordered[hi])
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


def _sorted_median(ordered: np.ndarray) -> float:
    """``np.median(x)`` of the values ``ordered`` (``np.sort(x)``, not empty)."""
    n = len(ordered)
    return float(ordered[n // 2]) if n % 2 else float((ordered[n // 2 - 1] + ordered[n // 2]) / 2)


def background_of(scores: np.ndarray, params: MomentParams) -> float:
    """The background level of a recording's window ``scores`` as ``params.background`` says."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if params.background == "median":
        return _sorted_median(np.sort(scores))
    return background_level(scores, params.merge_ratio)


def refine(
    spans: np.ndarray, scores: np.ndarray, peak: int, background: float, edge_level: float = 0.5,
    run: tuple[int, int] | None = None,
) -> tuple[float, float]:
    """Boundaries of the moment around window ``peak`` (its run of active windows ``run``, default
    the peak alone): the outermost crossings of ``edge_level`` of the way from ``background`` to the
    peak, on the curve through the window centres (step 2 of the module docstring)."""
    centres = spans.mean(axis=1)
    level = background + (scores[peak] - background) * edge_level
    first, last = run if run is not None else (peak, peak)
    left = _crossing(centres, scores, first, peak, level, -1)
    right = _crossing(centres, scores, last, peak, level, +1)
    start = float(spans[0, 0]) if isinstance(left, int) else left
    end = float(spans[-1, 1]) if isinstance(right, int) else right
    return start, end


def non_maximum_suppression(
    moments: Sequence[Moment], iou: float, limit: int | None = None
) -> list[Moment]:
    """Greedy NMS in descending score (ties: earlier start first); at most ``limit`` kept."""
    ranked = sorted(moments, key=lambda m: (-m.score, m.start, m.end))
    kept: list[Moment] = []
    for moment in ranked:
        if limit is not None and len(kept) >= limit:
            break
        if kept and temporal_iou([moment[:2]], [m[:2] for m in kept]).max() >= iou:
            continue
        kept.append(moment)
    return kept


def moments_from_scores(
    spans: np.ndarray, scores: np.ndarray, params: MomentParams | None = None, *, floor: float | None = None,
    background: float | None = None, top: float | None = None,
) -> list[Moment]:
    """Moments of one recording from its windows' ``spans`` (in time order) and ``scores``, best first.

    ``floor``: a run whose best window scores under it is not refined and not returned — a caller that keeps
    only moments scoring at least ``floor`` (a search's k-th best recording) gets the same moments, since
    suppression only ever drops a moment for a better one. On a noisy curve most runs are such, and refining
    them was most of a query's post-processing. ``background``: the recording's background level when the
    caller knows it (:func:`background_level` of all its windows, when ``spans`` are only some of them), and
    ``top`` its best window's score (default: the best of ``scores``)."""
    params = params or MomentParams()
    spans = np.asarray(spans, dtype=np.float64).reshape(-1, 2)
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if len(spans) != len(scores) or len(spans) == 0:
        raise ValueError(
            f"need one score per window, got {len(spans)} spans and {len(scores)} scores"
        )
    if not np.isfinite(scores).all():
        raise ValueError("window scores must be finite")
    if (np.diff(spans[:, 0]) < 0).any():
        raise ValueError("window spans must be in time order")
    if background is None:
        background = background_of(scores, params)
    best = float(scores.max()) if top is None else float(top)
    active = scores >= background + params.merge_ratio * (best - background)
    moments = []
    for first, last in _runs(active):
        peak = first + int(np.argmax(scores[first : last + 1]))
        if floor is not None and scores[peak] < floor:
            continue
        start, end = refine(spans, scores, peak, background, params.edge_level, (first, last))
        moments.append(Moment(start, end, float(scores[peak])))
    return non_maximum_suppression(moments, params.nms_iou, params.max_moments)
