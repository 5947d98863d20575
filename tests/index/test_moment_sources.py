"""search_sources against a brute-force reference: every recording's every window post-processed, all moments
ranked — the bounds it takes (the k best recordings only, runs under the k-th best not refined, bounded reads)
must not change the answer on noisy curves, where most runs are noise."""

from __future__ import annotations

import numpy as np
import pytest

from index.moments.postprocess import moments_from_scores, window_spans
from index.moments.sources import search_sources
from index.moments.windows import ExactWindows


def noisy_recordings(seed: int, n: int = 30, dim: int = 32) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Recordings of 1–20 min in 5-s windows every 2.5 s: a shared topic plus strong noise (many small runs),
    one planted event of 1–40 windows (some long)."""
    rng = np.random.default_rng(seed)
    topic = rng.standard_normal(dim)
    out = []
    for row in range(n):
        spans = window_spans(float(rng.uniform(60, 1200)), 5.0, 2.5)
        vectors = topic + 1.5 * rng.standard_normal((len(spans), dim))
        width = int(rng.integers(1, 41))
        first = int(rng.integers(0, max(1, len(spans) - width)))
        vectors[first : first + width] += 2.0 * rng.standard_normal(dim)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        out.append((row, spans, vectors.astype(np.float32)))
    return out


def reference(recordings, query: np.ndarray, k: int, min_score: float | None = None) -> list[tuple]:
    found = []
    for row, spans, vectors in recordings:
        for m in moments_from_scores(spans, vectors @ query):
            if min_score is None or m.score >= min_score:
                found.append((-m.score, row, m.start, m.end))
    found.sort()
    return found[:k]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 5, 10, 40])
def test_search_sources_returns_what_post_processing_every_window_returns(seed: int, k: int) -> None:
    recordings = noisy_recordings(seed)
    source = ExactWindows.of_recordings(recordings, dim=32)
    rng = np.random.default_rng(100 + seed)
    for _ in range(5):
        query = recordings[int(rng.integers(len(recordings)))][2].mean(axis=0) + 0.3 * rng.standard_normal(32)
        query = (query / np.linalg.norm(query)).astype(np.float32)
        expected = reference(recordings, query, k)
        assert_same(search_sources(query, k, [source]), expected)
        floor = float(-expected[len(expected) // 2][0])  # a min_score inside the answer
        assert_same(search_sources(query, k, [source], min_score=floor), reference(recordings, query, k, floor))


def assert_same(got, expected) -> None:
    assert len(got) == len(expected)
    np.testing.assert_allclose(np.array([(-h.score, h.key, h.start, h.end) for h in got]).reshape(-1, 4),
                               np.array(expected).reshape(-1, 4), rtol=0, atol=1e-9)


class PartedWindows(ExactWindows):
    """An in-memory ExcerptSource laid out as MilvusWindows lays windows out: parts of ``part`` windows and a
    sample of ``sample`` windows (None: every window, so the background is the whole recording's and the
    bounded answer must be the exact one). Counts the windows it hands out."""

    def __init__(self, recordings, dim: int, part: int = 32, sample: int | None = None, tell_hot: bool = False) -> None:
        kept = [(key, s, v) for key, s, v in recordings if len(s)]
        table = np.concatenate([np.column_stack([np.full(len(s), i, np.float64), s]) for i, (_, s, _) in enumerate(kept)])
        super().__init__(np.concatenate([v for _, _, v in kept]).astype(np.float32), table, [k for k, _, _ in kept])
        self.part, self.sample, self.read, self.tell_hot = part, sample, 0, tell_hot

    def best_recordings_hot(self, query, n, allowed=None):
        """With ``tell_hot`` every window of each recording (so no hot_windows search); else none known."""
        from index.moments.sources import HotWindows

        found = self.best_recordings(query, n, allowed)
        if not self.tell_hot:
            return found, {}
        hot = {}
        for (key, _), (_, vectors) in zip(found, self.windows_of([key for key, _ in found]), strict=True):
            scores = vectors @ query
            order = np.argsort(-scores, kind="stable")
            hot[key] = HotWindows(order.tolist(), scores[order].tolist(), -np.inf)
        return found, hot

    def hot_windows(self, query, keys, floor):
        out = []
        for _spans, vectors in self.windows_of(keys):
            scores = vectors @ query
            out.append(sorted({int(np.argmax(scores)), *np.flatnonzero(scores >= floor).tolist()}))
        return out

    def excerpts(self, wanted):
        from index.engines.milvus_windows import sample_positions
        from index.moments.sources import Excerpt, Stretch

        out = []
        for (_key, ranges), (spans, vectors) in zip(wanted, self.windows_of([k for k, _ in wanted]), strict=True):
            parts = sorted({p for a, b in ranges for p in range(max(0, a) // self.part, (max(a + 1, b) - 1) // self.part + 1)
                            if p * self.part < len(spans)})
            stretches: list[Stretch] = []
            for p in parts:
                a, b = p * self.part, min(len(spans), (p + 1) * self.part)
                if stretches and stretches[-1].stop == a:
                    a = stretches.pop().first
                stretches.append(Stretch(a, spans[a:b], vectors[a:b]))
            picked = np.arange(len(spans)) if self.sample is None else sample_positions(len(spans), self.sample)
            self.read += sum(len(s.spans) for s in stretches) + len(picked)
            out.append(Excerpt(len(spans), Stretch(0, spans[picked], vectors[picked]), stretches))
        return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 10, 40])
@pytest.mark.parametrize("tell_hot", [False, True])
def test_bounded_reads_give_the_exact_answer_when_the_sample_is_every_window(seed: int, k: int, tell_hot: bool) -> None:
    recordings = noisy_recordings(seed)
    source = PartedWindows(recordings, dim=32, part=8, tell_hot=tell_hot)
    rng = np.random.default_rng(200 + seed)
    for _ in range(5):
        query = recordings[int(rng.integers(len(recordings)))][2].mean(axis=0) + 0.3 * rng.standard_normal(32)
        query = (query / np.linalg.norm(query)).astype(np.float32)
        assert_same(search_sources(query, k, [source]), reference(recordings, query, k))


def test_bounded_reads_follow_an_event_covering_most_of_a_recording_and_read_little_of_short_ones() -> None:
    rng = np.random.default_rng(7)
    dim, event = 32, rng.standard_normal(32)
    recordings = []
    for row in range(12):
        spans = window_spans(1800.0, 5.0, 2.5)  # 30 min: 719 windows
        vectors = 1.2 * rng.standard_normal((len(spans), dim))
        width = 500 if row == 0 else 4  # recording 0: an event over 70 % of it
        first = 100 if row == 0 else int(rng.integers(0, len(spans) - width))
        vectors[first : first + width] += (3.0 if row == 0 else 2.5) * event
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        recordings.append((row, spans, vectors.astype(np.float32)))
    query = (event / np.linalg.norm(event)).astype(np.float32)
    source = PartedWindows(recordings, dim=dim, sample=64)
    hits = search_sources(query, 10, [source])
    long_one = next(h for h in hits if h.key == 0)
    assert long_one.start < 100 * 2.5 + 5 and long_one.end > 599 * 2.5  # the whole event, not a fragment
    source.read = 0
    short = search_sources(query, 5, [source], allowed=[lambda keys: np.asarray([key != 0 for key in keys])])
    assert len(short) == 5 and 0 < source.read < 0.15 * 5 * 719  # stretches and samples: a fraction of 5 recordings
    for hit in short:
        exact = reference([recordings[int(hit.key)]], query, 1)[0]
        assert abs(hit.start - exact[2]) < 1.0 and abs(hit.end - exact[3]) < 1.0
