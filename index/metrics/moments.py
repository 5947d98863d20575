"""Moment-retrieval metrics (docs/metrics.md, "Moments"): temporal IoU, Recall1@θ and mAP@[0.5:0.95].

Pure numpy, torch-free. The definitions are those of the evaluation script that Munakata et al.
(2024, Clotho-Moment / AM-DETR), CASTELLA (2025) and the DCASE 2026 audio moment retrieval task
reuse: Moment-DETR's ``standalone_eval`` (Lei et al., 2021, QVHighlights) as vendored by
``line/lighthouse`` (``training/standalone_eval/{eval,utils}.py``). A *query* is one caption of
one recording; its ground truth is a set of ``[start, end]`` windows in seconds; a prediction is a
ranked list of ``(start, end, score)`` moments in that recording.

- **Temporal IoU** of ``[s1, e1]`` and ``[s2, e2]``: ``max(0, min(e1, e2) - max(s1, s2))`` over
  ``(e1 - s1) + (e2 - s2) - intersection``; 0 where that union is 0 (two zero-length spans).
  Touching spans (``e1 == s2``) have IoU 0; a zero-length span has IoU 0 with anything.
- **Recall1@θ**: the top-scoring prediction is a hit when its IoU with the ground-truth window
  it overlaps most is ``≥ θ`` (``compute_mr_r1``). Reported at θ = 0.5 and 0.7.
- **AP@θ** (``compute_average_precision_detection``, the ActivityNet/MMAction2 detection AP): the
  top :data:`MAX_PREDICTIONS` predictions in score order are matched greedily — each to the
  still-unmatched ground-truth window of highest IoU if that IoU is ``≥ θ`` (a true positive),
  otherwise it is a false positive; AP is the area under the interpolated precision/recall curve
  (VOC 2011: precision made monotone from the right, recall runs to 1 with precision 0 beyond the
  last hit). **mAP@[0.5:0.95]** is the mean of AP@θ over :data:`MAP_IOU_THRESHOLDS` (0.5, 0.55, …,
  0.95), averaged over queries.

Decisions where the reference is silent or undefined (stated in docs/metrics.md too):

- A query with **no ground truth** is not a query: the reference crashes (Recall1 indexes an
  empty list) or divides by zero (AP's recall); such queries are skipped and counted in
  ``moment_n_skipped_{lang}``.
- A query with **no prediction** scores 0 on every metric (the reference's AP returns zeros).
- **Ties in score** keep the given order (the reference's stable ``sort``).
- **Ties in IoU** while matching: the reference walks a prediction's ground-truth windows in
  ``tiou_arr.argsort()[::-1]`` order — an ascending sort, reversed. Its numpy of 2021 sorted
  arrays of up to 16 elements by insertion sort, which is stable, so of two windows with equal IoU
  the *later* one (higher index in the query's ground truth) is tried first. We fix that order
  for any number of windows (a stable ascending sort, reversed): descending IoU, ties later window
  first. (numpy ≥ 2 with SIMD sorts no longer guarantees it even for 5 elements, so the reference
  run on today's numpy may itself differ on ties.)
- Per language: the mean over that language's queries; ``*_mean`` is the unweighted mean over the
  requested languages (as :mod:`index.metrics.retrieval` does).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from index.languages import validate_language_codes

MAP_IOU_THRESHOLDS: tuple[float, ...] = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))
"""0.5:0.05:0.95 — the thresholds mAP averages over (rounded as the reference rounds them)."""

RECALL_IOU_THRESHOLDS: tuple[float, ...] = (0.5, 0.7)
MAX_PREDICTIONS = 10
"""Predictions per query that AP sees (the reference's ``max_pred_windows``)."""

MOMENT_METRICS: tuple[str, ...] = ("R1@0.5", "R1@0.7", "mAP", "mAP@0.5", "mAP@0.75")
"""Report keys are ``moment_{metric}_{lang}`` and ``moment_{metric}_mean``; ``mAP`` is mAP@[0.5:0.95]."""


@dataclass(frozen=True)
class MomentQuery:
    """One caption of one recording, its ground-truth windows and the system's ranked moments.

    ``predictions`` are ``(start, end, score)`` triples in any order (they are sorted by score,
    ties keeping this order); ``ground_truth`` are ``(start, end)`` pairs, possibly empty.
    """

    language: str
    ground_truth: Sequence[tuple[float, float]]
    predictions: Sequence[tuple[float, float, float]] = field(default_factory=tuple)


def _spans(values: Iterable[Sequence[float]], *, name: str) -> np.ndarray:
    """``values`` as a finite ``(N, 2)`` float64 array with ``start <= end``, or ValueError."""
    array = np.asarray(list(values), dtype=np.float64).reshape(-1, 2)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must hold finite [start, end] pairs")
    if (array[:, 1] < array[:, 0]).any():
        raise ValueError(f"{name}: a span ends before it starts")
    return array


def temporal_iou(
    spans_a: Iterable[Sequence[float]], spans_b: Iterable[Sequence[float]]
) -> np.ndarray:
    """``(N, M)`` IoU of every span of ``spans_a`` with every span of ``spans_b`` (seconds)."""
    a = _spans(spans_a, name="spans_a")
    b = _spans(spans_b, name="spans_b")
    left = np.maximum(a[:, None, 0], b[None, :, 0])
    right = np.minimum(a[:, None, 1], b[None, :, 1])
    inter = np.clip(right - left, 0.0, None)
    union = (a[:, 1] - a[:, 0])[:, None] + (b[:, 1] - b[:, 0])[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def _ranked(predictions: Sequence[tuple[float, float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Prediction spans and scores sorted by descending score, ties in the given order."""
    if not predictions:
        return np.zeros((0, 2)), np.zeros(0)
    array = np.asarray(predictions, dtype=np.float64).reshape(-1, 3)
    if not np.isfinite(array[:, 2]).all():
        raise ValueError("prediction scores must be finite")
    order = np.argsort(-array[:, 2], kind="stable")
    return _spans(array[order, :2], name="predictions"), array[order, 2]


def recall_at_one(
    ground_truth: Sequence[tuple[float, float]],
    predictions: Sequence[tuple[float, float, float]],
    thresholds: Sequence[float] = RECALL_IOU_THRESHOLDS,
) -> np.ndarray:
    """Per threshold, 1.0 when the top prediction's best IoU with the ground truth is ``≥ θ``."""
    gt = _spans(ground_truth, name="ground_truth")
    spans, _ = _ranked(predictions)
    if len(spans) == 0 or len(gt) == 0:
        return np.zeros(len(thresholds))
    best = float(temporal_iou(spans[:1], gt).max())
    return np.array([1.0 if best >= t else 0.0 for t in thresholds])


def _interpolated_ap(precision: np.ndarray, recall: np.ndarray) -> float:
    """Area under the VOC-2011 interpolated precision/recall curve."""
    mprec = np.concatenate([[0.0], precision, [0.0]])
    mrec = np.concatenate([[0.0], recall, [1.0]])
    mprec = np.maximum.accumulate(mprec[::-1])[::-1]
    steps = np.flatnonzero(mrec[1:] != mrec[:-1]) + 1
    return float(np.sum((mrec[steps] - mrec[steps - 1]) * mprec[steps]))


def _walk_order(iou: np.ndarray) -> np.ndarray:
    """Ground-truth indices by descending IoU, ties later window first (the reference's order,
    module docstring): a stable ascending sort, reversed."""
    return np.argsort(iou, kind="stable")[::-1]


def average_precision(
    ground_truth: Sequence[tuple[float, float]],
    predictions: Sequence[tuple[float, float, float]],
    thresholds: Sequence[float] = MAP_IOU_THRESHOLDS,
    max_predictions: int = MAX_PREDICTIONS,
) -> np.ndarray:
    """AP of one query at each IoU threshold (greedy matching in score order, module docstring)."""
    gt = _spans(ground_truth, name="ground_truth")
    spans, _ = _ranked(predictions)
    spans = spans[:max_predictions]
    aps = np.zeros(len(thresholds))
    if len(spans) == 0 or len(gt) == 0:
        return aps
    iou = temporal_iou(spans, gt)
    for t_idx, threshold in enumerate(thresholds):
        matched = np.zeros(len(gt), dtype=bool)
        hits = np.zeros(len(spans))
        for p_idx in range(len(spans)):
            for g_idx in _walk_order(iou[p_idx]):
                if iou[p_idx, g_idx] < threshold:
                    break
                if not matched[g_idx]:
                    matched[g_idx] = True
                    hits[p_idx] = 1.0
                    break
        tp = np.cumsum(hits)
        precision = tp / np.arange(1, len(spans) + 1)
        aps[t_idx] = _interpolated_ap(precision, tp / len(gt))
    return aps


def _query_scores(query: MomentQuery) -> dict[str, float]:
    r1 = recall_at_one(query.ground_truth, query.predictions, RECALL_IOU_THRESHOLDS)
    ap = average_precision(query.ground_truth, query.predictions, MAP_IOU_THRESHOLDS)
    return {
        "R1@0.5": float(r1[0]),
        "R1@0.7": float(r1[1]),
        "mAP": float(ap.mean()),
        "mAP@0.5": float(ap[MAP_IOU_THRESHOLDS.index(0.5)]),
        "mAP@0.75": float(ap[MAP_IOU_THRESHOLDS.index(0.75)]),
    }


def moment_report(queries: Iterable[MomentQuery], languages: Sequence[str]) -> dict[str, float]:
    """Per-language and mean moment metrics (fractions in [0, 1]) of ``queries``.

    Keys: ``moment_{R1@0.5,R1@0.7,mAP,mAP@0.5,mAP@0.75}_{lang}`` and ``..._mean``,
    ``moment_n_queries_{lang}`` and ``moment_n_skipped_{lang}`` (queries without ground truth).
    A language with no scored query has no metric keys (its counts say why), and does not enter
    the mean; queries in a language not requested are ignored.
    """
    validate_language_codes(list(languages))
    per_lang: dict[str, list[dict[str, float]]] = {lang: [] for lang in languages}
    skipped = dict.fromkeys(languages, 0)
    for query in queries:
        if query.language not in per_lang:
            continue
        if len(query.ground_truth) == 0:
            skipped[query.language] += 1
            continue
        per_lang[query.language].append(_query_scores(query))
    report: dict[str, float] = {}
    for lang in languages:
        report[f"moment_n_queries_{lang}"] = float(len(per_lang[lang]))
        report[f"moment_n_skipped_{lang}"] = float(skipped[lang])
        for metric in MOMENT_METRICS:
            if per_lang[lang]:
                report[f"moment_{metric}_{lang}"] = float(
                    np.mean([s[metric] for s in per_lang[lang]])
                )
    scored = [lang for lang in languages if per_lang[lang]]
    for metric in MOMENT_METRICS:
        if scored:
            report[f"moment_{metric}_mean"] = float(
                np.mean([report[f"moment_{metric}_{lang}"] for lang in scored])
            )
    return report
