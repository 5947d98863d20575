"""FAISS beyond memory (issue 22 item 6): the by-size choice of on-disk inverted lists, and the
sharded build that gives the in-memory index's results, resumes shard by shard and loads from a
moved bundle directory. Small sizes here; 1 M / 10 M are bench/index_scale.py's."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from index.engines.faiss_index import (
    all_vectors,
    apply_search_params,
    build_index,
    choose_factory,
    load_index,
    parse_factory,
    search,
)
from index.engines.faiss_ondisk import (
    IVFDATA_SUFFIX,
    build_and_save,
    build_sharded,
    exact_top_k_streamed,
    use_ondisk,
)

FACTORY = "IVF64,SQfp16"


@pytest.fixture(scope="module")
def vectors(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """20 000 clustered unit vectors (d=32), saved and memory-mapped as the sharded build reads them."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((50, 32)).astype(np.float32)
    x = centres[rng.integers(0, 50, 20_000)] + 0.5 * rng.standard_normal((20_000, 32)).astype(np.float32)
    path = tmp_path_factory.mktemp("vectors") / "x.npy"
    np.save(path, (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32))
    return np.load(path, mmap_mode="r")


def test_lists_go_to_disk_by_size() -> None:
    ten_m, one_m = choose_factory(10_000_000, 256), choose_factory(1_000_000, 256)
    assert use_ondisk(parse_factory(ten_m, 256), 10_000_000, 256)  # 5 GB of SQfp16 codes
    assert not use_ondisk(parse_factory(one_m, 256), 1_000_000, 256)  # 0.5 GB stays in memory
    assert not use_ondisk(parse_factory("Flat", 256), 10_000_000, 256)
    assert use_ondisk(parse_factory("IVF1024,PQ32", 256), 100_000_000, 256)
    assert not use_ondisk(parse_factory("IVF1024,PQ32", 256), 10_000_000, 256)  # 400 MB


def test_sharded_build_matches_the_in_memory_index_and_resumes(vectors: np.ndarray, tmp_path: Path) -> None:
    out, work = tmp_path / "bundle" / "audio.faiss", tmp_path / "work"
    out.parent.mkdir()
    first = build_sharded(vectors, out, FACTORY, work=work, shard_rows=6_000, budget_s=0)
    assert (first.built, first.shards_done, first.shards_total) == (None, 0, 4)  # trained, no shard yet
    assert (work / "trained.faiss").exists() and not out.exists()
    done = build_sharded(vectors, out, FACTORY, work=work, shard_rows=6_000)
    assert done.built is not None and done.shards_done == 4
    assert out.with_suffix(IVFDATA_SUFFIX).stat().st_size > 20_000 * 32 * 2  # the codes live in the side file
    assert done.built.ann_recall_at_10 >= 0.97
    memory = build_index(np.asarray(vectors), FACTORY)  # same training rows, same seeded k-means
    params = done.built.search_params
    apply_search_params(memory.index, params)
    moved = tmp_path / "moved"
    shutil.move(out.parent, moved)  # the bundle directory is renamed at publish
    loaded = load_index(moved / out.name, spec=parse_factory(FACTORY, 32), search_params=params)
    assert loaded.ntotal == 20_000
    queries = np.asarray(vectors[:200])
    got_scores, got_rows = search(loaded, queries, 10, params=params)
    want_scores, want_rows = search(memory.index, queries, 10, params=params)
    assert (got_rows == want_rows).all()
    np.testing.assert_allclose(got_scores, want_scores, atol=1e-6)
    # the vectors read back (consistency diagnostic, Milvus publish) are the in-memory index's
    np.testing.assert_array_equal(all_vectors(loaded), all_vectors(memory.index))


def test_streamed_exact_search_is_exact(vectors: np.ndarray) -> None:
    queries = np.asarray(vectors[:20])
    full = np.sort(np.asarray(vectors) @ queries.T, axis=0)[::-1][:10].T
    np.testing.assert_allclose(exact_top_k_streamed(vectors, queries, 10, chunk=3_000), full, atol=1e-5)


def test_build_and_save_picks_the_path_by_size(vectors: np.ndarray, tmp_path: Path) -> None:
    small = build_and_save(np.asarray(vectors), tmp_path / "a.faiss", FACTORY)
    assert not (tmp_path / "a.ivfdata").exists()
    large = build_and_save(np.asarray(vectors), tmp_path / "b.faiss", FACTORY, ondisk_min_bytes=1)
    assert (tmp_path / "b.ivfdata").exists() and not list(tmp_path.glob(".shards-*"))
    assert small.search_params == large.search_params
