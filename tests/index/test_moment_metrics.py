"""Moment metrics against hand-computed cases (index/metrics/moments.py, docs/metrics.md "Moments")."""

from __future__ import annotations

import numpy as np
import pytest

from index.metrics.moments import (
    MAP_IOU_THRESHOLDS,
    MomentQuery,
    average_precision,
    moment_report,
    recall_at_one,
    temporal_iou,
)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((0, 10), (5, 15), 5 / 15),  # partial overlap
        ((0, 5), (5, 10), 0.0),  # touching: no intersection
        ((2, 4), (0, 10), 0.2),  # contained
        ((0, 10), (0, 10), 1.0),  # identical
        ((0, 1), (7, 9), 0.0),  # disjoint
        ((3, 3), (0, 10), 0.0),  # zero-length inside a span
        ((3, 3), (3, 3), 0.0),  # two zero-length spans: union 0 → 0, not NaN
    ],
)
def test_temporal_iou_edge_cases(a, b, expected):
    assert temporal_iou([a], [b])[0, 0] == pytest.approx(expected)
    assert temporal_iou([b], [a])[0, 0] == pytest.approx(expected)


def test_temporal_iou_is_a_cross_matrix_and_rejects_reversed_spans():
    iou = temporal_iou([(0, 10), (20, 30)], [(0, 5), (25, 30), (100, 101)])
    np.testing.assert_allclose(iou, [[0.5, 0, 0], [0, 0.5, 0]])
    with pytest.raises(ValueError, match="ends before it starts"):
        temporal_iou([(5, 4)], [(0, 1)])


def test_recall_at_one_uses_the_best_matching_ground_truth_and_counts_iou_equal_to_threshold():
    gt = [(0, 10), (20, 30)]
    # (21, 31) against (20, 30): 9 / 11 = 0.818 — a hit at 0.5 and 0.7, even though (0, 10) is first
    np.testing.assert_array_equal(recall_at_one(gt, [(21, 31, 0.9), (0, 10, 0.5)]), [1, 1])
    # (23, 30) against (20, 30): exactly 0.7 — IoU ≥ θ is a hit
    np.testing.assert_array_equal(recall_at_one(gt, [(23, 30, 0.9)]), [1, 1])
    # 0.6: a hit at 0.5 only
    np.testing.assert_array_equal(recall_at_one(gt, [(24, 30, 0.9)]), [1, 0])
    # the top prediction is the best-scored one, not the first given
    np.testing.assert_array_equal(recall_at_one(gt, [(50, 60, 0.1), (0, 10, 0.9)]), [1, 1])


def test_recall_at_one_ties_keep_the_given_order_and_no_prediction_is_a_miss():
    gt = [(20, 30)]
    np.testing.assert_array_equal(recall_at_one(gt, [(0, 10, 0.5), (20, 30, 0.5)]), [0, 0])
    np.testing.assert_array_equal(recall_at_one(gt, [(20, 30, 0.5), (0, 10, 0.5)]), [1, 1])
    np.testing.assert_array_equal(recall_at_one(gt, []), [0, 0])


def test_average_precision_hand_computed_duplicate_then_second_moment():
    # p1 hits (0,10); p2 overlaps (0,10) already matched and (20,30) not at all → FP; p3 hits (20,30).
    # precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1; interpolated AP = 1/2·1 + 1/2·2/3 = 5/6.
    ap = average_precision([(0, 10), (20, 30)], [(0, 10, 0.9), (1, 11, 0.8), (20, 30, 0.7)])
    np.testing.assert_allclose(ap, np.full(10, 5 / 6))


def test_average_precision_per_threshold_and_its_mean():
    # IoU 0.8: a hit at 0.5 … 0.8 (7 thresholds), a miss at 0.85, 0.9, 0.95 → mAP 0.7
    ap = average_precision([(0, 10)], [(0, 8, 0.9)])
    np.testing.assert_array_equal(ap, [1, 1, 1, 1, 1, 1, 1, 0, 0, 0])
    assert ap.mean() == pytest.approx(0.7)
    assert MAP_IOU_THRESHOLDS == (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


def test_average_precision_false_positive_first_and_the_ten_prediction_cap():
    # FP then TP: precision 0, 1/2 at recall 0, 1 → AP 1/2
    np.testing.assert_allclose(average_precision([(0, 10)], [(50, 60, 0.9), (0, 10, 0.8)]), 0.5)
    # the hit ranked 11th is past the cap → AP 0; with the cap lifted, 1/11
    misses = [(100 + 10 * i, 105 + 10 * i, 1.0 - 0.01 * i) for i in range(10)]
    preds = [*misses, (0, 10, 0.5)]
    np.testing.assert_allclose(average_precision([(0, 10)], preds), 0.0)
    np.testing.assert_allclose(average_precision([(0, 10)], preds, max_predictions=11), 1 / 11)
    # nothing predicted, or a duplicate after the hit (a FP past full recall costs nothing)
    np.testing.assert_allclose(average_precision([(0, 10)], []), 0.0)
    np.testing.assert_allclose(average_precision([(0, 10)], [(0, 10, 0.9), (0, 10, 0.8)]), 1.0)


def test_average_precision_one_prediction_matches_one_ground_truth_only():
    # two ground-truth windows, one prediction covering both halves well: recall ≤ 1/2
    ap = average_precision([(0, 10), (10, 20)], [(0, 10, 0.9)])
    np.testing.assert_allclose(ap, 0.5)


def test_moment_report_per_language_skips_queries_without_ground_truth():
    queries = [
        MomentQuery("eng", [(0, 10)], [(0, 10, 0.9)]),  # perfect
        MomentQuery("eng", [(0, 10)], [(0, 6, 0.9)]),  # IoU 0.6: R1@0.5 only; AP 1 at 0.5..0.6
        MomentQuery("fra", [], [(0, 10, 0.9)]),  # no ground truth: skipped
        MomentQuery("deu", [(0, 10)], [(0, 10, 0.9)]),  # a language not asked for: ignored
    ]
    report = moment_report(queries, ["eng", "fra"])
    assert report["moment_R1@0.5_eng"] == pytest.approx(1.0)
    assert report["moment_R1@0.7_eng"] == pytest.approx(0.5)
    assert report["moment_mAP_eng"] == pytest.approx((1.0 + 0.3) / 2)
    assert report["moment_mAP@0.5_eng"] == pytest.approx(1.0)
    assert report["moment_mAP@0.75_eng"] == pytest.approx(0.5)
    assert report["moment_n_queries_eng"] == 2 and report["moment_n_skipped_eng"] == 0
    assert report["moment_n_queries_fra"] == 0 and report["moment_n_skipped_fra"] == 1
    assert "moment_R1@0.5_fra" not in report  # undefined, not NaN
    assert report["moment_R1@0.7_mean"] == pytest.approx(0.5)  # the mean of the scored languages


def _reference_ap(ground_truth, predictions, thresholds=MAP_IOU_THRESHOLDS, *, later_first=True):
    """Moment-DETR ``standalone_eval``'s ``compute_average_precision_detection`` for one query,
    re-stated in plain Python from its documented procedure (not a call into index/metrics): the
    predictions by descending score; per threshold, each walks the ground-truth windows by IoU
    from ``argsort()[::-1]`` — an ascending stable sort (insertion sort on the ≤ 16 windows of a
    query), reversed, so of two equal IoUs the later window comes first — stops at the first IoU
    below the threshold (a false positive), skips a window already taken, else takes it (a true
    positive); a prediction that took nothing is a false positive. AP: VOC-2011 interpolation.
    ``later_first=False`` is the order this module used before (earlier window first)."""

    def iou(a, b):
        inter = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
        union = (a[1] - a[0]) + (b[1] - b[0]) - inter
        return inter / union if union > 0 else 0.0

    preds = sorted(predictions, key=lambda p: -p[2])
    aps = []
    for threshold in thresholds:
        taken = [False] * len(ground_truth)
        tp, fp = [], []
        for pred in preds:
            ious = [iou(pred, gt) for gt in ground_truth]
            ascending = sorted(range(len(ground_truth)), key=lambda j: ious[j])  # Python's sort is stable
            walk = ascending[::-1] if later_first else sorted(range(len(ground_truth)), key=lambda j: -ious[j])
            hit = False
            for j in walk:
                if ious[j] < threshold:
                    break
                if taken[j]:
                    continue
                taken[j] = hit = True
                break
            tp.append(1.0 if hit else 0.0)
            fp.append(0.0 if hit else 1.0)
        if not preds:
            aps.append(0.0)
            continue
        cum_tp = [sum(tp[: i + 1]) for i in range(len(tp))]
        cum_fp = [sum(fp[: i + 1]) for i in range(len(fp))]
        recall = [c / len(ground_truth) for c in cum_tp]
        precision = [t / (t + f) for t, f in zip(cum_tp, cum_fp, strict=True)]
        mprec = [0.0, *precision, 0.0]
        mrec = [0.0, *recall, 1.0]
        for i in range(len(mprec) - 2, -1, -1):
            mprec[i] = max(mprec[i], mprec[i + 1])
        aps.append(sum((mrec[i] - mrec[i - 1]) * mprec[i] for i in range(1, len(mrec)) if mrec[i] != mrec[i - 1]))
    return np.array(aps)


def test_an_iou_tie_between_two_ground_truth_windows_takes_the_later_one_as_the_reference_does():
    # (1, 11) has IoU 9/11 = 0.82 with both (0, 10) and (2, 12). The reference gives it (2, 12),
    # the later window; then (0, 10) finds its own window free: two hits, AP 1 up to θ = 0.8 (and
    # at 0.85+ (1, 11) misses: FP then TP, AP 1/2 · 1/2). Taking (0, 10) first would leave (0, 10)
    # only (2, 12) at IoU 8/12 = 0.67 — a false positive at 0.7, 0.75 and 0.8 (AP 1/2).
    gt = [(0, 10), (2, 12)]
    preds = [(1, 11, 0.9), (0, 10, 0.8)]
    expected = [1, 1, 1, 1, 1, 1, 1, 0.25, 0.25, 0.25]
    np.testing.assert_allclose(average_precision(gt, preds), expected)
    np.testing.assert_allclose(_reference_ap(gt, preds), expected)
    earlier_first = [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25]
    np.testing.assert_allclose(_reference_ap(gt, preds, later_first=False), earlier_first)


def test_average_precision_equals_the_reference_procedure_on_tie_heavy_random_queries():
    rng = np.random.default_rng(0)
    differs_from_earlier_first = 0
    for _ in range(400):
        # spans on a 1-s grid in a 12-s recording: equal IoUs are common
        starts = rng.integers(0, 9, size=rng.integers(1, 5))
        gt = [(float(s), float(s + rng.integers(2, 5))) for s in starts]
        preds = []
        for rank in range(rng.integers(1, 7)):
            s = int(rng.integers(0, 9))
            preds.append((float(s), float(s + rng.integers(2, 5)), 1.0 - 0.1 * rank))
        reference = _reference_ap(gt, preds)
        np.testing.assert_allclose(average_precision(gt, preds), reference, err_msg=f"{gt} {preds}")
        differs_from_earlier_first += not np.allclose(_reference_ap(gt, preds, later_first=False), reference)
    assert differs_from_earlier_first > 0  # the draw does exercise the tie order
