"""index/moments/faiss_windows.py and sources.py: the bundle's windows behind an ANN index (issue 54, part 4).

A synthetic set of many recordings (not one): 600 recordings of 40 windows (24,000 windows, 64-d) in 20 scenes,
each a drifting background with, in a third of them, a 4-window event. The exact source (ExactWindows) is the reference; the
FAISS source must return the same top moment for ≥ 95 % of the queries (event queries and random ones), read its
vectors memory-mapped, and save its index so that the next open reads it. ~7 s of CPU (two index builds)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from index.moments import faiss_windows
from index.moments.faiss_windows import (
    MIN_CANDIDATES,
    MOMENT_INDEX_DIR,
    FaissWindows,
    build_index,
    subquantizers,
)
from index.moments.postprocess import moments_from_scores
from index.moments.sources import search_sources
from index.moments.windows import WINDOWS_FILE, ExactWindows, write_windows
from index.runtime import loader
from index.runtime.loader import LoadedBundle

DIM, RECORDINGS, WINDOWS = 64, 600, 40


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _noise(rng: np.random.Generator, size, norm: float) -> np.ndarray:
    """Gaussian noise of about ``norm`` per vector."""
    return rng.normal(scale=norm / np.sqrt(DIM), size=size)


@pytest.fixture(scope="module")
def many_recordings(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """A folder with moments/windows.npy and spans.npy of the synthetic set; the queries (60 of events, 40 of
    scenes: many recordings compete for those)."""
    rng = np.random.default_rng(54)
    scenes = _unit(rng.normal(size=(20, DIM)))
    events = _unit(rng.normal(size=(RECORDINGS // 3, DIM)))
    recordings = []
    for r in range(RECORDINGS):
        base = scenes[r % 20] + _noise(rng, DIM, 0.6)
        vectors = _unit(base + np.cumsum(_noise(rng, (WINDOWS, DIM), 0.15), axis=0))  # a background that drifts
        if r % 3 == 0:
            at = int(rng.integers(0, WINDOWS - 4))
            vectors[at : at + 4] = _unit(events[r // 3] + _noise(rng, (4, DIM), 0.4))
        starts = np.arange(WINDOWS) * 0.5
        recordings.append((r * 2 + 1, np.column_stack([starts, starts + 1.0]), vectors))  # rows with gaps
    root = tmp_path_factory.mktemp("many_recordings")  # the index cache of the tests below: root / "cache"
    assert write_windows(root, recordings) == (RECORDINGS * WINDOWS, RECORDINGS)
    queries = np.concatenate([_unit(events[:60] + _noise(rng, (60, DIM), 0.3)),
                              _unit(scenes[rng.integers(0, 20, 40)] + _noise(rng, (40, DIM), 0.5))])
    return root, queries


def test_faiss_windows_top_moment_agrees_with_exact_search(many_recordings) -> None:
    root, queries = many_recordings
    exact = ExactWindows.load(root)
    ann = FaissWindows(root, cache_dir=root / "cache")
    assert ann.n_recordings == RECORDINGS
    agree = 0
    for query in queries:
        (want,) = search_sources(query, 1, [exact])
        (got,) = search_sources(query, 1, [ann])
        agree += (got.key, got.start, got.end) == (want.key, want.start, want.end)
        assert got.score <= want.score + 1e-6  # an ANN answer never beats the exact one
    recall = agree / len(queries)
    print(f"top-moment recall of FaissWindows against exact search: {recall:.3f} over {len(queries)} queries")
    assert recall >= 0.95

    # k = 10: the moments come from recordings the exact search ranks near the top too
    hits = search_sources(queries[0], 10, [ann])
    assert len(hits) == 10 and hits[0].score >= hits[-1].score


def test_faiss_windows_reads_the_vectors_memory_mapped_and_only_the_candidates_rows(many_recordings,
                                                                                    tmp_path: Path) -> None:
    root, queries = many_recordings
    first = FaissWindows(root, cache_dir=tmp_path)
    assert first.build_seconds > 0 and list(tmp_path.glob("*.faiss"))
    again = FaissWindows(root, cache_dir=tmp_path)
    assert again.build_seconds == 0.0, "the saved index was not read"
    assert isinstance(again.vectors, np.memmap) and isinstance(again.spans, np.memmap)
    assert again.index.ntotal == first.index.ntotal == RECORDINGS * WINDOWS

    exact = ExactWindows.load(root)
    keys = [1, 601, 1199]
    for (spans, vectors), (want_spans, want_vectors) in zip(again.windows_of(keys), exact.windows_of(keys), strict=True):
        assert not isinstance(vectors, np.memmap)  # a copy of these rows, not a view of the file
        np.testing.assert_array_equal(spans, want_spans)
        np.testing.assert_array_equal(vectors, want_vectors)
    assert again.windows_of([2])[0][0].shape == (0, 2)  # a row without windows


def test_an_allowed_filter_is_asked_about_candidates_and_honoured(many_recordings) -> None:
    root, queries = many_recordings
    ann = FaissWindows(root, cache_dir=root / "cache")
    asked: list[int] = []

    def only_high_rows(keys):
        asked.extend(int(k) for k in keys)
        return np.asarray(keys) > 1000  # 100 of the 600 recordings

    found = ann.best_recordings(queries[0], 5, only_high_rows)
    assert len(found) == 5 and all(int(k) > 1000 for k, _ in found)
    assert len(asked) < RECORDINGS  # candidates only, never every recording
    exact = [k for k, _ in ExactWindows.load(root).best_recordings(queries[0], 5, only_high_rows)]
    assert [k for k, _ in found][:1] == exact[:1]


def test_a_filter_passing_few_recordings_ranks_them_exactly(many_recordings, monkeypatch) -> None:
    root, queries = many_recordings
    ann, exact = FaissWindows(root, cache_dir=root / "cache"), ExactWindows.load(root)
    monkeypatch.setattr(faiss_windows, "MAX_CANDIDATES", MIN_CANDIDATES)  # no growth: the exact fallback

    def three(keys):
        return np.isin(np.asarray(keys), [1, 601, 1199])

    for query in queries[:5]:
        got, want = ann.best_recordings(query, 2, three), exact.best_recordings(query, 2, three)
        assert [k for k, _ in got] == [k for k, _ in want]
        np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-5)


def test_subquantizers_divide_the_dimension_and_a_small_set_still_builds() -> None:
    assert subquantizers(512) == 64 and subquantizers(64) == 8 and subquantizers(100) == 10 and subquantizers(3) == 1
    assert build_index(np.eye(8, dtype=np.float32).repeat(40, axis=0), nlist=2).ntotal == 320
    assert build_index(_unit(np.random.default_rng(0).normal(size=(20, DIM)))).ntotal == 20  # 1 list, 4-bit codes


def test_the_loader_opens_faiss_windows_from_the_threshold_and_exact_windows_below(many_recordings, monkeypatch) -> None:
    """index/runtime/loader.py moment_windows on the synthetic set, the threshold set around its size."""
    root, _ = many_recordings
    bundle = SimpleNamespace(path=root, _moment_lock=threading.Lock(), _moment_windows=None, manifest=SimpleNamespace(
        files={}, moments=SimpleNamespace(n_windows=RECORDINGS * WINDOWS, windows_file=WINDOWS_FILE)))
    monkeypatch.setattr(loader, "FAISS_MIN_WINDOWS", RECORDINGS * WINDOWS)
    opened = LoadedBundle.moment_windows(bundle)
    assert isinstance(opened, FaissWindows) and LoadedBundle.moment_windows(bundle) is opened
    assert list((root.parent / MOMENT_INDEX_DIR).glob("*.faiss")), "the index was not kept beside the bundles"

    bundle._moment_windows = None
    monkeypatch.setattr(loader, "FAISS_MIN_WINDOWS", RECORDINGS * WINDOWS + 1)
    assert isinstance(LoadedBundle.moment_windows(bundle), ExactWindows)


def test_the_top_k_over_sources_equals_post_processing_every_recording(many_recordings) -> None:
    """search_sources reads the best recordings only (and stops once k moments beat the next one's best window);
    the answer is the one post-processing every recording of both sources gives."""
    root, queries = many_recordings
    exact = ExactWindows.load(root)
    keys = exact.keys
    half = len(keys) // 2
    first = ExactWindows.of_recordings([(k, *exact.windows_of([k])[0]) for k in keys[:half]], DIM)
    second = ExactWindows.of_recordings([(f"item-{k}", *exact.windows_of([k])[0]) for k in keys[half:]], DIM)
    for query in queries[[0, 70]]:
        everything = []
        for index, source in enumerate((first, second)):
            for key, (spans, vectors) in zip(source.keys, source.windows_of(source.keys), strict=True):
                everything += [(m.score, index, str(key), m.start) for m in moments_from_scores(spans, vectors @ query)]
        everything.sort(key=lambda h: -h[0])
        for k in (1, 10, 50):
            got = search_sources(query, k, [first, second])
            assert [(h.score, h.source, str(h.key), h.start) for h in got] == everything[:k]
