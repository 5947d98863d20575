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
