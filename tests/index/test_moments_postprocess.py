"""Window scores → moments on constructed score curves (index/moments/postprocess.py)."""

from __future__ import annotations

import numpy as np
import pytest

from index.metrics.moments import temporal_iou
from index.moments.postprocess import (
    LEGACY_MOMENT_PARAMS,
    Moment,
    MomentParams,
    _sorted_median,
    _sorted_quantile,
    background_level,
    moments_from_scores,
    non_maximum_suppression,
    window_spans,
)


def _linear(heard: np.ndarray) -> np.ndarray:
    return heard


def _measured(heard: np.ndarray) -> np.ndarray:
    """The demo encoder's response (index/moments/postprocess.py's docstring): a window's share of
    the height grows about 1.5 times as fast as the share of the event it hears, and saturates once
    it hears two thirds of it (0.55 measured at a third, 0.80 at 0.5-0.6, 0.95 from 0.8 up)."""
    return np.minimum(1.0, 1.5 * heard)


def _curve(
    spans: np.ndarray, events: list[tuple[float, float, float]], background: float = 0.1, response=_linear
) -> np.ndarray:
    """A window's score rises with the fraction of the event it hears (of the event or the window,
    whichever is shorter), through ``response``: :func:`_linear` is the ideal curve of a window
    encoder, :func:`_measured` the one a real encoder draws."""
    scores = np.full(len(spans), background)
    for start, end, peak in events:
        overlap = np.clip(np.minimum(spans[:, 1], end) - np.maximum(spans[:, 0], start), 0, None)
        full = min(end - start, float(spans[0, 1] - spans[0, 0]))
        scores = np.maximum(scores, background + (peak - background) * response(overlap / full))
    return scores


def test_window_spans_cover_the_recording_with_the_last_window_moved_left():
    np.testing.assert_allclose(window_spans(25, 10, 5), [[0, 10], [5, 15], [10, 20], [15, 25]])
    np.testing.assert_allclose(window_spans(27, 10, 5)[-2:], [[15, 25], [17, 27]])
    np.testing.assert_allclose(window_spans(8, 10, 5), [[0, 8]])
    with pytest.raises(ValueError):
        window_spans(60, 4, 5)


@pytest.mark.parametrize(("hop", "event"), [(1.0, (20.0, 30.0)), (1.5, (20.3, 30.1))])
def test_half_height_edges_are_exact_on_the_ideal_curve(hop, event):
    """The rule before issue 54 (LEGACY_MOMENT_PARAMS) on a curve linear in the share heard."""
    spans = window_spans(60, 4, hop)
    moments = moments_from_scores(spans, _curve(spans, [(*event, 0.6)]), LEGACY_MOMENT_PARAMS)
    assert len(moments) == 1
    assert moments[0].start == pytest.approx(event[0], abs=1e-9)
    assert moments[0].end == pytest.approx(event[1], abs=1e-9)
    assert moments[0].score == pytest.approx(0.6)


@pytest.mark.parametrize(("hop", "event"), [(1.0, (20.0, 30.0)), (1.5, (20.3, 30.1)), (2.0, (20.7, 31.2))])
def test_an_event_longer_than_the_window_is_found_within_a_third_of_a_second_of_its_edges(hop, event):
    """On the measured response the half-height crossing lands where a window hears a third of the
    event: 2/3 s outside each edge in 4-s windows. The 0.65 level lands within 0.3 s."""
    spans = window_spans(60, 4, hop)
    scores = _curve(spans, [(*event, 0.6)], response=_measured)
    (moment,) = moments_from_scores(spans, scores)
    assert abs(moment.start - event[0]) <= 0.3 and abs(moment.end - event[1]) <= 0.3
    assert moment.score == pytest.approx(0.6)
    (before,) = moments_from_scores(spans, scores, LEGACY_MOMENT_PARAMS)
    assert event[0] - before.start >= 0.6 and before.end - event[1] >= 0.6


@pytest.mark.parametrize("hop", [1.0, 2.5])
def test_a_short_event_is_not_stretched_beyond_a_quarter_window(hop):
    """Issue 54 (a): a 4.5-s event in 5-s windows came out 6.1 s long. Now at most a quarter of a
    window (1.25 s) longer than the event, each edge within 0.6 s, at every offset of the event
    against the windows; the half-height rule gives 6.25-6.7 s on the same curves."""
    window = 5.0
    for offset in np.arange(0.0, hop, 0.25):
        spans = window_spans(60, window, hop)
        start, end = 30.0 + offset, 34.5 + offset
        scores = _curve(spans, [(start, end, 0.6)], response=_measured)
        moment = moments_from_scores(spans, scores)[0]
        assert moment.end - moment.start <= (end - start) + window / 4, (offset, moment)
        assert abs(moment.start - start) <= 0.6 and abs(moment.end - end) <= 0.6, (offset, moment)
        assert temporal_iou([moment[:2]], [(start, end)])[0, 0] >= 0.78
        before = moments_from_scores(spans, scores, LEGACY_MOMENT_PARAMS)[0]
        assert before.end - before.start >= 6.2, (offset, before)


def test_an_event_shorter_than_the_window_comes_out_about_one_window_long_centred_on_it():
    spans = window_spans(60, 4, 1)
    scores = _curve(spans, [(40, 41, 0.7)], response=_measured)
    (moment,) = moments_from_scores(spans, scores)
    assert (moment.start + moment.end) / 2 == pytest.approx(40.5)
    assert 3.5 <= moment.end - moment.start <= 4.5
    (before,) = moments_from_scores(spans, _curve(spans, [(40, 41, 0.7)]), LEGACY_MOMENT_PARAMS)
    assert (before.start, before.end) == pytest.approx((38.5, 42.5))


def test_an_event_covering_70_percent_of_the_recording_is_one_moment():
    """Issue 54 (b): with the median as background, the median is a score of the event itself, the
    merge level sits inside its ups and downs, and it broke into fragments none of which was
    found. The background is now the median of the windows outside it."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        spans = window_spans(100, 5, 2.5)
        clean = _curve(spans, [(20, 90, 0.6)], response=_measured)
        scores = clean + rng.normal(0, 0.03, len(spans))  # the event's ups and downs, and the bed's
        found = moments_from_scores(spans, scores)
        overlapping = [m for m in found if temporal_iou([m[:2]], [(20, 90)])[0, 0] > 0]
        assert len(overlapping) == 1, (trial, found)
        assert temporal_iou([found[0][:2]], [(20, 90)])[0, 0] >= 0.7, (trial, found)
        before = moments_from_scores(spans, scores, LEGACY_MOMENT_PARAMS)
        assert temporal_iou([before[0][:2]], [(20, 90)])[0, 0] < 0.7


def test_a_dip_inside_the_run_does_not_cut_the_moment_short():
    """Edges are the outermost crossings of the edge level around the run: a window inside the
    event that dips below it (0.55 of the height, above the merge level) is passed over."""
    spans = window_spans(60, 4, 1)
    scores = _curve(spans, [(20, 40, 0.6)], response=_measured)
    inside = int(np.flatnonzero(spans[:, 0] == 35)[0])  # [35, 39]: wholly inside the event
    scores[inside] = 0.1 + 0.55 * 0.5
    (moment,) = moments_from_scores(spans, scores)
    assert abs(moment.start - 20) <= 0.3 and abs(moment.end - 40) <= 0.3


def test_the_background_is_the_median_unless_one_event_covers_most_of_the_recording():
    spans = window_spans(100, 5, 2.5)
    short = _curve(spans, [(20, 25, 0.6), (60, 64, 0.5)], background=0.1)
    assert background_level(short) == pytest.approx(np.median(short)) == pytest.approx(0.1)
    long = _curve(spans, [(20, 90, 0.6)], background=0.1)
    assert np.median(long) == pytest.approx(0.6)  # the median is the event's
    assert background_level(long) < 0.2  # the windows outside it: the bed and the edges' ramps
    whole = _curve(spans, [(0, 100, 0.6)], background=0.1)
    assert background_level(whole) == pytest.approx(np.quantile(whole, 0.1))


def test_two_events_two_moments_best_first_and_the_edge_of_the_recording():
    spans = window_spans(60, 4, 1)
    moments = moments_from_scores(spans, _curve(spans, [(0, 8, 0.5), (30, 40, 0.9)], response=_measured))
    assert [m.score for m in moments] == pytest.approx([0.9, 0.5])
    assert (moments[0].start, moments[0].end) == pytest.approx((30, 40), abs=0.3)
    # the first event runs from the recording's start: the curve never drops left of it
    assert moments[1].start == 0.0
    assert moments[1].end == pytest.approx(8, abs=0.3)


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
    with pytest.raises(ValueError, match="edge_level"):
        MomentParams(edge_level=1.0)
    with pytest.raises(ValueError, match="background"):
        MomentParams(background="mean")  # type: ignore[arg-type]


def test_the_sorted_quantile_and_median_are_numpys_bit_for_bit() -> None:
    """background_level reads its quantile and medians off one sorted copy instead of np.quantile / np.median
    (their call overhead was two thirds of a recording's post-processing); the values must not move at all."""
    rng = np.random.default_rng(54)
    for _ in range(3000):
        values = rng.normal(size=int(rng.integers(1, 400))) * rng.uniform(0.01, 2.0)
        ordered = np.sort(values)
        for q in (0.1, 0.25, 0.5, 0.9):
            assert _sorted_quantile(ordered, q) == float(np.quantile(values, q))
        assert _sorted_median(ordered) == float(np.median(values))
