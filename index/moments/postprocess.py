"""From window scores to moments (SPEC §19): merge, refine, suppress — pure numpy, torch-free.

A long recording is indexed as windows of ``window`` seconds every ``hop`` seconds
(:func:`window_spans`); a query scores each window (cosine of the embeddings). The sliding-window
baseline of Munakata et al. (2024) turns that score curve into moments in three steps
(:func:`moments_from_scores`, docs/service.md "Moments"):

1. **Merge.** With ``b`` the recording's median window score (its background) and ``P`` its best,
   windows scoring at least ``b + merge_ratio · (P - b)`` are *active*; each run of adjacent active
   windows becomes one moment, scored by its best window ``p``.
2. **Refine.** The curve is read as piecewise linear through the window centres. A moment's
   boundaries are where it crosses its half maximum ``h = b + (p - b) / 2``, searched outward from
   the run's best window and interpolated between the two centres around the crossing. For an
   event longer than the window, the window centred on its edge half overlaps it, so the
   crossing lands on the edge; a shorter event comes out one window long, centred on it. A curve
   still above ``h`` at either end of the recording stops at the recording's edge.
3. **Suppress.** Non-maximum suppression in score order drops a moment whose IoU with a kept one
   reaches ``nms_iou`` (refinement can make neighbouring runs overlap), then keeps at most
   ``max_moments``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from index.metrics.moments import temporal_iou


class Moment(NamedTuple):
    """A span of a recording (seconds) and its score."""

    start: float
    end: float
    score: float


@dataclass(frozen=True)
class MomentParams:
    """Post-processing knobs; the defaults are the service's and the evaluator's."""

    merge_ratio: float = 0.5
    """Fraction of the way from the median to the best score a window must reach to be merged."""
    nms_iou: float = 0.5
    """A moment overlapping a better one of the same recording by this IoU or more is dropped."""
    max_moments: int = 10
    """Moments kept per recording (the metrics' ``MAX_PREDICTIONS``)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.merge_ratio <= 1.0:
            raise ValueError(f"merge_ratio must lie in (0, 1], got {self.merge_ratio}")
        if not 0.0 < self.nms_iou <= 1.0:
            raise ValueError(f"nms_iou must lie in (0, 1], got {self.nms_iou}")
        if self.max_moments < 1:
            raise ValueError(f"max_moments must be at least 1, got {self.max_moments}")


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
    centres: np.ndarray, scores: np.ndarray, peak: int, level: float, step: int
) -> int | float:
    """Where the curve first drops below ``level`` walking from ``peak`` by ``step`` (±1): the
    interpolated time, or the index ``-1``/``len`` when it never does."""
    i = peak
    while 0 <= i + step < len(scores) and scores[i + step] >= level:
        i += step
    j = i + step
    if not 0 <= j < len(scores):
        return j
    inside, outside = scores[i], scores[j]
    fraction = (inside - level) / (inside - outside)
    return float(centres[i] + fraction * (centres[j] - centres[i]))


def refine(
    spans: np.ndarray, scores: np.ndarray, peak: int, background: float
) -> tuple[float, float]:
    """Half-maximum boundaries of the hump around window ``peak`` (step 2 of the module docstring)."""
    centres = spans.mean(axis=1)
    level = background + (scores[peak] - background) / 2.0
    left = _crossing(centres, scores, peak, level, -1)
    right = _crossing(centres, scores, peak, level, +1)
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
    spans: np.ndarray, scores: np.ndarray, params: MomentParams | None = None
) -> list[Moment]:
    """Moments of one recording from its windows' ``spans`` (in time order) and ``scores``, best first."""
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
    background = float(np.median(scores))
    best = float(scores.max())
    active = scores >= background + params.merge_ratio * (best - background)
    moments = []
    for first, last in _runs(active):
        peak = first + int(np.argmax(scores[first : last + 1]))
        start, end = refine(spans, scores, peak, background)
        moments.append(Moment(start, end, float(scores[peak])))
    return non_maximum_suppression(moments, params.nms_iou, params.max_moments)
