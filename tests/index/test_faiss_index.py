"""FAISS index choice, building, recall check, filtered search, memory-mapped loading (small synthetic vectors)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np
import pytest

from index.engines.faiss_index import (
    IndexConfigError,
    ann_recall_at_k,
    available_cores,
    build_index,
    choose_factory,
    faiss_threads,
    load_index,
    parse_factory,
    save_index,
    search,
)
from tonearm.errors import BundleError


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def clustered() -> np.ndarray:
    """2000 unit vectors in 32 dims around 40 centres (an ANN-friendly, realistic layout)."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((40, 32))
    return unit(centres[rng.integers(0, 40, 2000)] + 0.3 * rng.standard_normal((2000, 32)))


def brute_force(vectors: np.ndarray, queries: np.ndarray, k: int, rows: np.ndarray | None = None):
    rows = np.arange(len(vectors)) if rows is None else rows
    scores = queries @ vectors[rows].T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, axis=1), rows[order]


@pytest.mark.parametrize("factory", ["Flat", "HNSW32,Flat", "IVF64,Flat", "IVF16,PQ8", "IVF64,SQ8", "IVF64,SQfp16"])
def test_parse_accepts_checked_forms(factory):
    assert parse_factory(factory, 32).factory == factory


@pytest.mark.parametrize(
    "factory", ["HNSW32", "PCA16,Flat", "IVF64,SQ4", "LSH", "IVF64,PQ7", "IVF0,Flat", "Flat,IDMap", "OPQ8,IVF16,PQ8"]
)
def test_parse_rejects_unchecked_or_invalid_forms(factory):
    with pytest.raises(IndexConfigError, match="factory"):
        parse_factory(factory, 32)


def test_choose_factory_by_size():
    assert choose_factory(1_000, 256) == "Flat"
    assert choose_factory(50_000, 256) == "Flat"
    assert choose_factory(50_001, 256) == "IVF256,SQfp16"  # sqrt(n) lists, at least 256
    assert choose_factory(1_000_000, 256) == "IVF1024,SQfp16"
    assert choose_factory(20_000_000, 256) == "IVF4096,SQfp16"
    # 4 * sqrt(3e7) = 21909 -> nearest power of two 2^14; PQ64 = 4 dims per sub-quantizer.
    assert choose_factory(30_000_000, 256) == "IVF16384,PQ64"
    assert choose_factory(30_000_000, 30) == "IVF16384,PQ6"  # largest divisor of 30 that is <= 30 // 4 = 7


def test_flat_is_exact(clustered):
    built = build_index(clustered, "Flat")
    queries = clustered[:50] + 0.01
    scores, rows = search(built.index, queries, 10, params=built.search_params)
    expected_scores, _ = brute_force(clustered, queries, 10)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-5)
    assert built.ann_recall_at_10 == 1.0 and rows.dtype == np.int64


@pytest.mark.parametrize(("factory", "param"), [("HNSW16,Flat", "efSearch"), ("IVF32,Flat", "nprobe"), ("IVF32,SQfp16", "nprobe"), ("IVF32,PQ8", "nprobe")]
)
def test_ann_build_measures_recall_and_fixes_search_params(clustered, factory, param):
    built = build_index(clustered, factory, queries=clustered[::7])
    assert param in built.search_params
    concrete = faiss.downcast_index(built.index)
    fixed = concrete.hnsw.efSearch if param == "efSearch" else concrete.nprobe
    assert fixed == built.search_params[param]
    again = ann_recall_at_k(built.index, clustered, clustered[::7], k=10, params=built.search_params)
    assert again == pytest.approx(built.ann_recall_at_10)
    assert built.ann_recall_at_10 >= (0.5 if "PQ" in factory else 0.9)


def test_nprobe_is_raised_until_recall_reaches_the_target():
    rng = np.random.default_rng(4)  # unclustered vectors: few probes miss many neighbours
    vectors, queries = unit(rng.standard_normal((3000, 32))), unit(rng.standard_normal((300, 32)))
    loose = build_index(vectors, "IVF64,SQfp16", queries=queries, recall_target=0.0)
    strict = build_index(vectors, "IVF64,SQfp16", queries=queries, recall_target=0.99)
    assert loose.search_params == {"nprobe": 8}  # the start: max(8, nlist // 64)
    assert strict.search_params["nprobe"] > 8 and strict.search_params["nprobe"] in (16, 32, 64)
    assert strict.ann_recall_at_10 >= 0.99 > loose.ann_recall_at_10
    assert faiss.downcast_index(strict.index).nprobe == strict.search_params["nprobe"]


def test_language_filtered_recall_counts_toward_the_target():
    rng = np.random.default_rng(5)
    vectors, queries = unit(rng.standard_normal((3000, 32))), unit(rng.standard_normal((300, 32)))
    ranges = {"eng": (0, 2700), "jpn": (2700, 3000)}  # a small language: its neighbours sit in few lists
    plain = build_index(vectors, "IVF64,SQfp16", queries=queries, recall_target=0.9)
    filtered = build_index(vectors, "IVF64,SQfp16", queries=queries, recall_target=0.9, language_ranges=ranges)
    jpn = faiss.IDSelectorRange(2700, 3000)
    exact_jpn = brute_force(vectors, queries, 10, rows=np.arange(2700, 3000))[0]
    jpn_recall = {
        name: ann_recall_at_k(built.index, vectors, queries, k=10, params=built.search_params,
                              exact_scores=exact_jpn, selector=jpn)
        for name, built in (("plain", plain), ("filtered", filtered))
    }
    assert jpn_recall["plain"] < 0.9 <= jpn_recall["filtered"]  # tuned unfiltered only, jpn searches miss
    assert filtered.ann_recall_at_10 <= jpn_recall["filtered"]  # the manifest records the worst case
    assert filtered.search_params["nprobe"] > plain.search_params["nprobe"]


def test_builds_use_every_core_and_restore_the_thread_count():
    seen = []
    faiss.omp_set_num_threads(1)  # what importing torch with torch.set_num_threads(1) leaves behind
    with faiss_threads():
        seen.append(faiss.omp_get_max_threads())
    assert seen == [available_cores()] and faiss.omp_get_max_threads() == 1


def test_ivf_needs_enough_training_vectors(clustered):
    with pytest.raises(IndexConfigError, match="at least 4096"):
        build_index(clustered, "IVF4096,Flat")


def _id_mapped(vectors: np.ndarray, ids: np.ndarray) -> faiss.Index:
    """A flat index whose internal order differs from the row ids (to change tie order)."""
    index = faiss.IndexIDMap(faiss.IndexFlatIP(vectors.shape[1]))
    index.add_with_ids(vectors[ids], ids)
    return index


def test_recall_is_tie_tolerant():
    rng = np.random.default_rng(1)
    vectors = unit(rng.standard_normal((60, 8)))
    vectors[:20] = vectors[0]  # 20 identical best matches for the query below
    query = vectors[:1].copy()
    reversed_ids = np.arange(60)[::-1].copy()
    index = _id_mapped(vectors, reversed_ids)
    _, exact_rows = brute_force(vectors, query, 10)
    _, ann_rows = index.search(query, 10)
    assert set(exact_rows[0]) != set(ann_rows[0])  # a strict id comparison would score this below 1
    assert ann_recall_at_k(index, vectors, query, k=10) == 1.0


def test_recall_counts_wrong_neighbours():
    rng = np.random.default_rng(2)
    vectors = unit(rng.standard_normal((200, 16)))
    scrambled = faiss.IndexIDMap(faiss.IndexFlatIP(16))
    scrambled.add_with_ids(vectors, rng.permutation(200))  # returned ids point at the wrong vectors
    assert ann_recall_at_k(scrambled, vectors, vectors[:50], k=10) < 0.3


@pytest.mark.parametrize("factory", ["Flat", "HNSW32,Flat", "IVF16,Flat"])
def test_filtered_search_matches_brute_force_over_the_range(clustered, factory):
    built = build_index(clustered, factory)
    params = dict(built.search_params)
    if "nprobe" in params:  # exhaustive probing: the filtered result must be exact
        params["nprobe"] = 16
    queries = clustered[1500:1520]
    selector = faiss.IDSelectorRange(500, 900)
    scores, rows = search(built.index, queries, 5, params=params, selector=selector)
    assert ((rows >= 500) & (rows < 900)).all()
    expected_scores, _ = brute_force(clustered, queries, 5, rows=np.arange(500, 900))
    np.testing.assert_allclose(scores, expected_scores, atol=1e-4)
    concrete = faiss.downcast_index(built.index)
    if "nprobe" in built.search_params:  # the per-call params did not touch the shared index
        assert concrete.nprobe == built.search_params["nprobe"]


def test_missing_hits_are_minus_one_with_minus_inf_scores():
    vectors = unit(np.random.default_rng(3).standard_normal((5, 8)))
    built = build_index(vectors, "Flat")
    scores, rows = search(built.index, vectors[:2], 8, params={})
    assert (rows[:, 5:] == -1).all() and np.isneginf(scores[:, 5:]).all()
    assert (rows[:, :5] >= 0).all()
    with pytest.raises(ValueError, match="k must be"):
        search(built.index, vectors[:2], 0, params={})


@pytest.mark.parametrize("factory", ["Flat", "HNSW16,Flat", "IVF16,Flat", "IVF16,SQfp16", "IVF16,PQ8"])
def test_memory_mapped_load_gives_identical_results(clustered, factory, tmp_path):
    built = build_index(clustered, factory)
    path = tmp_path / "x.faiss"
    save_index(built.index, path)
    spec = parse_factory(factory, 32)
    in_memory = load_index(path, spec=spec, search_params=built.search_params)
    mapped = load_index(path, spec=spec, search_params=built.search_params, mmap_threshold_bytes=0)
    queries = clustered[:30]
    expected = search(built.index, queries, 10, params=built.search_params)
    for loaded in (in_memory, mapped):
        got = search(loaded, queries, 10, params=built.search_params)
        np.testing.assert_array_equal(got[1], expected[1])
        np.testing.assert_allclose(got[0], expected[0], atol=1e-6)


def test_load_rejects_l2_indices_and_garbage(tmp_path):
    index = faiss.IndexFlatL2(4)
    index.add(np.eye(4, dtype=np.float32))
    faiss.write_index(index, str(tmp_path / "l2.faiss"))
    with pytest.raises(BundleError, match="inner product"):
        load_index(tmp_path / "l2.faiss", spec=parse_factory("Flat", 4), search_params={})
    (tmp_path / "bad.faiss").write_bytes(b"not an index at all")
    with pytest.raises(BundleError, match="bad.faiss"):
        load_index(tmp_path / "bad.faiss", spec=parse_factory("Flat", 4), search_params={})


def test_concurrent_filtered_searches_agree_with_sequential(clustered):
    built = build_index(clustered, "HNSW16,Flat")
    ranges = [(0, 500), (500, 1000), (1000, 2000), None]
    jobs = [(i, ranges[i % 4]) for i in range(40)]

    def run(job):
        i, bounds = job
        selector = None if bounds is None else faiss.IDSelectorRange(*bounds)
        return search(built.index, clustered[i * 10 : i * 10 + 10], 10, params=built.search_params, selector=selector)

    sequential = [run(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(run, jobs))
    for (s_scores, s_rows), (c_scores, c_rows) in zip(sequential, concurrent, strict=True):
        np.testing.assert_array_equal(s_rows, c_rows)
        np.testing.assert_array_equal(s_scores, c_scores)


def test_training_uses_a_sample_but_every_vector_is_added(clustered):
    built = build_index(clustered, "IVF8,Flat", max_train_vectors=300)
    assert built.index.ntotal == len(clustered)
    params = {"nprobe": 8}  # all lists: exact despite the small training sample
    scores, _ = search(built.index, clustered[:20], 10, params=params)
    np.testing.assert_allclose(scores, brute_force(clustered, clustered[:20], 10)[0], atol=1e-5)
