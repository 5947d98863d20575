"""Window scores → moments on constructed score curves (index/moments/postprocess.py)."""

from __future__ import annotations

import numpy as np
import pytest

from index.moments.postprocess import (
    Moment,
    MomentParams,
    moments_from_scores,
    non_maximum_suppression,
    window_spans,
)


def _curve(
    spans: np.ndarray, events: list[tuple[float, float, float]], background: float = 0.1
) -> np.ndarray:
    """A window's score rises with the fraction of the event it hears (of the event or the window,
    whichever is shorter): the ideal curve of a window encoder."""
    scores = np.full(len(spans), background)
    for start, end, peak in events:
        overlap = np.clip(np.minimum(spans[:, 1], end) - np.maximum(spans[:, 0], start), 0, None)
        full = min(end - start, float(spans[0, 1] - spans[0, 0]))
        scores = np.maximum(scores, background + (peak - background) * overlap / full)
    return scores


def test_window_spans_cover_the_recording_with_the_last_window_moved_left():
    np.testing.assert_allclose(window_spans(25, 10, 5), [[0, 10], [5, 15], [10, 20], [15, 25]])
    np.testing.assert_allclose(window_spans(27, 10, 5)[-2:], [[15, 25], [17, 27]])
    np.testing.assert_allclose(window_spans(8, 10, 5), [[0, 8]])
    with pytest.raises(ValueError):
        window_spans(60, 4, 5)


@pytest.mark.parametrize(("hop", "event"), [(1.0, (20.0, 30.0)), (1.5, (20.3, 30.1))])
def test_one_event_longer_than_the_window_is_found_at_its_boundaries(hop, event):
    spans = window_spans(60, 4, hop)
    moments = moments_from_scores(spans, _curve(spans, [(*event, 0.6)]))
    assert len(moments) == 1
    assert moments[0].start == pytest.approx(event[0], abs=1e-9)
    assert moments[0].end == pytest.approx(event[1], abs=1e-9)
    assert moments[0].score == pytest.approx(0.6)


def test_an_event_shorter_than_the_window_comes_out_one_window_long_centred_on_it():
    spans = window_spans(60, 4, 1)
    (moment,) = moments_from_scores(spans, _curve(spans, [(40, 41, 0.7)]))
    assert (moment.start, moment.end) == pytest.approx((38.5, 42.5))


def test_two_events_two_moments_best_first_and_the_edge_of_the_recording():
    spans = window_spans(60, 4, 1)
    moments = moments_from_scores(spans, _curve(spans, [(0, 8, 0.5), (30, 40, 0.9)]))
    assert [m.score for m in moments] == pytest.approx([0.9, 0.5])
    assert (moments[0].start, moments[0].end) == pytest.approx((30, 40))
    # the first event runs from the recording's start: the curve never drops left of it
    assert (moments[1].start, moments[1].end) == pytest.approx((0, 8))


def test_a_weak_second_event_below_the_merge_level_is_not_a_moment():
    spans = window_spans(60, 4, 1)
    scores = _curve(spans, [(10, 20, 0.9), (40, 45, 0.3)])  # 0.3 < 0.1 + 0.5 · (0.9 - 0.1)
    assert len(moments_from_scores(spans, scores)) == 1
    assert len(moments_from_scores(spans, scores, MomentParams(merge_ratio=0.2))) == 2


def test_nms_drops_the_second_peak_of_one_hump():
    spans = window_spans(20, 2, 1)
    scores = np.zeros(len(spans))
    scores[8:13] = [0.5, 1.0, 0.85, 0.95, 0.5]  # a dip splits the active windows at merge_ratio 0.9
    params = MomentParams(merge_ratio=0.9)
    kept = moments_from_scores(spans, scores, params)
    assert [m.score for m in kept] == [1.0]
    both = moments_from_scores(spans, scores, MomentParams(merge_ratio=0.9, nms_iou=1.0))
    assert [m.score for m in both] == [1.0, 0.95]


def test_a_flat_curve_is_one_moment_over_the_whole_recording():
    spans = window_spans(30, 10, 5)
    assert moments_from_scores(spans, np.full(len(spans), 0.3)) == [Moment(0.0, 30.0, 0.3)]


def test_non_maximum_suppression_order_threshold_and_limit():
    moments = [Moment(1, 11, 0.8), Moment(20, 30, 0.7), Moment(0, 10, 0.9), Moment(5, 15, 0.6)]
    # (1, 11) vs (0, 10): IoU 9/11 → dropped; (5, 15) vs (0, 10): 1/3 → kept
    assert non_maximum_suppression(moments, 0.5) == [
        Moment(0, 10, 0.9),
        Moment(20, 30, 0.7),
        Moment(5, 15, 0.6),
    ]
    assert non_maximum_suppression(moments, 0.3) == [Moment(0, 10, 0.9), Moment(20, 30, 0.7)]
    assert non_maximum_suppression(moments, 0.5, limit=1) == [Moment(0, 10, 0.9)]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="one score per window"):
        moments_from_scores(window_spans(30, 10, 5), np.zeros(2))
    with pytest.raises(ValueError, match="finite"):
        moments_from_scores([[0, 10]], [np.nan])
    with pytest.raises(ValueError):
        MomentParams(merge_ratio=0)
