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
