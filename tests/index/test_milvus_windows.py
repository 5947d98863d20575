"""Moment windows in Milvus (index/engines/milvus_windows.py), on both engines (the session's 2.3.5 server and
milvus-lite): the best recordings equal an exact search over the same windows (with a filter), a recording
read back is its windows in time order (float16-stored: cosines within 1e-3), a put replaces what a key held
(fewer windows: the rest go), a delete removes every window. ~3 s per engine (a few hundred windows)."""

from __future__ import annotations

import uuid

import numpy as np

from index.engines.milvus_index import MilvusTarget
from index.engines.milvus_windows import MilvusWindows, exact_best_recordings
from tests.milvus_server import require_milvus

require_milvus()

DIM = 24


def _recording(rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
    centre = rng.standard_normal(DIM)
    vectors = (centre + 0.6 * rng.standard_normal((m, DIM))).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    starts = 2.5 * np.arange(m)
    return np.stack([starts, starts + 5.0], axis=1), vectors


def _exact(recordings: dict[str, tuple[np.ndarray, np.ndarray]], query: np.ndarray) -> list[tuple[str, float]]:
    best = {key: float((vectors @ query).max()) for key, (_, vectors) in recordings.items()}
    return sorted(best.items(), key=lambda pair: -pair[1])


def test_windows_in_milvus_answer_as_exact_search_and_follow_puts_and_deletes(milvus_uri: str) -> None:
    rng = np.random.default_rng(7)
    source = MilvusWindows(MilvusTarget(uri=milvus_uri), f"t_{uuid.uuid4().hex[:8]}_windows", dim=DIM).ensure()
    try:
        recordings = {f"rec-{i}": _recording(rng, 3 + 7 * i) for i in range(12)}
        source.put([(key, spans, vectors) for key, (spans, vectors) in recordings.items()])
        assert source.count() == sum(len(s) for s, _ in recordings.values())
        for q in range(5):
            query = recordings[f"rec-{q}"][1][1] + 0.3 * rng.standard_normal(DIM).astype(np.float32)
            query /= np.linalg.norm(query)
            found = source.best_recordings(query, 4)
            expected = _exact(recordings, query)[:4]
            assert [key for key, _ in found] == [key for key, _ in expected]
            np.testing.assert_allclose([s for _, s in found], [s for _, s in expected], atol=1e-5)
            odd = source.best_recordings(query, 3, allowed=lambda keys: np.array([int(str(k)[4:]) % 2 == 1 for k in keys]))
            assert [key for key, _ in odd] == [key for key, _ in _exact(recordings, query) if int(key[4:]) % 2][:3]

        read = source.windows_of(["rec-5", "missing", "rec-2"])
        for key, (spans, vectors) in zip(["rec-5", "missing", "rec-2"], read, strict=True):
            if key == "missing":
                assert spans.shape == (0, 2) and vectors.shape == (0, DIM)
                continue
            np.testing.assert_array_equal(spans, recordings[key][0])  # time order, exact seconds
            assert np.abs(vectors @ recordings[key][1].T - recordings[key][1] @ recordings[key][1].T).max() < 1e-3

        shorter = _recording(rng, 4)  # rec-9 again with 4 windows: the other 63 go
        source.put([("rec-9", *shorter), ("rec-3", np.zeros((0, 2)), np.zeros((0, DIM)))])
        source.delete(["rec-11"])
        recordings["rec-9"] = shorter
        del recordings["rec-3"], recordings["rec-11"]
        assert source.count() == sum(len(s) for s, _ in recordings.values())
        np.testing.assert_array_equal(source.windows_of(["rec-9"])[0][0], shorter[0])
        for key in ("rec-3", "rec-11"):
            query = rng.standard_normal(DIM).astype(np.float32)
            found = source.best_recordings(query / np.linalg.norm(query), len(recordings) + 2)
            assert key not in {k for k, _ in found} and len(found) == len(recordings)
            assert source.windows_of([key])[0][0].shape == (0, 2)
    finally:
        source.drop()


def test_exact_best_recordings_reads_the_windows_by_chunks() -> None:
    rng = np.random.default_rng(3)
    recordings = [_recording(rng, m) for m in (5, 9, 2, 14)]
    vectors = np.concatenate([v for _, v in recordings])
    bounds = np.cumsum([0] + [len(v) for _, v in recordings])
    table = [(10 + i, int(bounds[i]), int(bounds[i + 1])) for i in range(len(recordings))]
    queries = vectors[[1, 7, 20]]
    for chunk in (3, 100):
        found = exact_best_recordings(vectors, table, queries, 2, chunk=chunk)
        for q, query in enumerate(queries):
            best = [float((v @ query).max()) for _, v in recordings]
            assert found[q] == [10 + i for i in np.argsort(best)[::-1][:2]]


def test_moment_search_reads_stretches_and_a_sample_and_finds_what_exact_search_finds(milvus_uri: str) -> None:
    """The bounded reads of the moment search (index.moments.sources.ExcerptSource) against the exact source over
    the same windows: same top moments (edges within a window's hop), parts read around the hot windows only, and
    a key written without a sample row (before samples existed) read whole."""
    from index.engines.milvus_windows import SAMPLE_PART, sample_positions
    from index.moments.sources import search_sources
    from index.moments.windows import ExactWindows

    rng = np.random.default_rng(11)
    event = rng.standard_normal(DIM)
    recordings = {}
    for i in range(10):
        spans, vectors = _recording(rng, 120 + 37 * i)
        at = int(rng.integers(0, len(spans) - 6))
        vectors[at : at + 4] += (1.5 + 0.1 * i) * event / np.linalg.norm(event)
        recordings[f"rec-{i}"] = (spans, vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    source = MilvusWindows(MilvusTarget(uri=milvus_uri), f"t_{uuid.uuid4().hex[:8]}_windows", dim=DIM).ensure()
    try:
        source.put([(key, spans, vectors) for key, (spans, vectors) in recordings.items()])
        exact = ExactWindows.of_recordings([(key, s, v) for key, (s, v) in recordings.items()], DIM)
        query = (event / np.linalg.norm(event)).astype(np.float32)
        for k in (1, 5):
            got, want = search_sources(query, k, [source]), search_sources(query, k, [exact])
            assert [h.key for h in got] == [h.key for h in want]
            np.testing.assert_allclose([(h.start, h.end) for h in got], [(h.start, h.end) for h in want], atol=2.5)

        hot = source.hot_windows(query, ["rec-3"], floor=0.5)[0]
        assert hot and (recordings["rec-3"][1][hot] @ query).max() == (recordings["rec-3"][1] @ query).max()
        excerpt = source.excerpts([("rec-3", [(40, 41)])])[0]
        assert excerpt is not None and excerpt.n_windows == 231
        first = 40 // source._per_part * source._per_part
        assert [(s.first, s.stop) for s in excerpt.stretches] == [(first, first + source._per_part)]
        np.testing.assert_array_equal(excerpt.stretches[0].spans, recordings["rec-3"][0][first : first + source._per_part])
        picked = sample_positions(231, source._per_sample)
        np.testing.assert_array_equal(excerpt.sample.spans, recordings["rec-3"][0][picked])

        source.target.call("delete", source.parts, filter='pid == "rec-3#s"', bulk=True)  # as written before samples
        assert source.excerpts([("rec-3", [(40, 41)])]) == [None]
        assert SAMPLE_PART < 0 and len(source.windows_of(["rec-3"])[0][0]) == 231  # the sample row is not a part
        got = search_sources(query, 10, [source])
        assert [h.key for h in got] == [h.key for h in search_sources(query, 10, [exact])]
    finally:
        source.drop()
