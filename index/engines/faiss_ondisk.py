"""FAISS indices beyond memory: IVF built in shards, inverted lists on disk (SPEC §12, ~10 M vectors).

:func:`index.engines.faiss_index.build_index` holds the float32 vectors and the whole index in memory;
at 10 M × 256 that is 10 GB of vectors plus 5 GB of SQfp16 codes. :func:`build_sharded`
instead (the recipe of faiss ``contrib/ondisk.py`` and its ``bench_all_ivf`` demos):

1. **train** the IVF quantizer and codec on a seeded sample of at most ``max_train_vectors``
   rows (read from a memory-mapped ``.npy``, never loaded whole) → ``work/trained.faiss``;
2. **add** the rows in shards of ``shard_rows`` (global ids) → ``work/shard_NNNN.faiss``, one
   file each, so an interrupted or time-boxed build resumes at the next missing shard;
3. **merge** the shards' inverted lists into one ``OnDiskInvertedLists`` file
   (``<name>.ivfdata`` beside ``<name>.faiss``): searching maps it, so resident memory is the
   quantizer plus the pages the probed lists touch, not the codes;
4. **tune** ``nprobe`` as :func:`build_index` does (doubled until recall@10 against exact search
   reaches the target), the exact top-10 of the sample queries computed shard by shard.

Which path a collection takes is chosen by size (:func:`use_ondisk`): above
:data:`ONDISK_MIN_BYTES` of codes the lists go to disk; the factory itself is still
:func:`index.engines.faiss_index.choose_factory`'s (:func:`build_and_save` is what `tonearm index` and
the export call). The bundle keeps both files; :func:`index.engines.faiss_index.load_index` opens the
``.ivfdata`` from the index file's own directory (``IO_FLAG_ONDISK_SAME_DIR``), so a bundle can
be moved or copied. Such an index cannot be cloned, so
:func:`index.engines.faiss_index.all_vectors` reads it back list by list.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from faiss.contrib.ondisk import merge_ondisk

from index.engines.faiss_index import (
    MAX_TRAIN_VECTORS,
    RECALL_QUERIES,
    RECALL_TARGET,
    TIE_TOLERANCE,
    BuiltIndex,
    FactorySpec,
    apply_search_params,
    choose_factory,
    default_search_params,
    faiss_threads,
    parse_factory,
    search,
)

log = logging.getLogger(__name__)
_faiss: Any = faiss

SHARD_ROWS = 1_000_000
ONDISK_MIN_BYTES = 2 << 30
"""IVF codes above this (2 GiB: 4 M vectors of SQfp16 at d=256) get on-disk inverted lists."""
IVFDATA_SUFFIX = ".ivfdata"


def code_bytes(spec: FactorySpec, n: int, dim: int) -> int:
    """Bytes of an IVF index's codes for ``n`` vectors (ids add 8 bytes a vector)."""
    per_vector = {"ivf_flat": 4 * dim, "ivf_pq": spec.m}.get(spec.kind)
    if per_vector is None:  # ivf_sq
        per_vector = dim * (2 if spec.factory.endswith("fp16") else 1)
    return n * (per_vector + 8)


def use_ondisk(spec: FactorySpec, n: int, dim: int, min_bytes: int = ONDISK_MIN_BYTES) -> bool:
    """The by-size choice: IVF indices whose codes exceed ``min_bytes`` keep their lists on disk."""
    return spec.is_ivf and code_bytes(spec, n, dim) > min_bytes


@dataclass(frozen=True)
class ShardedBuild:
    """Where a sharded build stands: ``built`` is None until every shard is added and merged."""

    built: BuiltIndex | None
    shards_done: int
    shards_total: int


def build_sharded(
    vectors: np.ndarray,
    out: Path,
    factory: str | None = None,
    *,
    work: Path,
    queries: np.ndarray | None = None,
    shard_rows: int = SHARD_ROWS,
    seed: int = 0,
    max_train_vectors: int = MAX_TRAIN_VECTORS,
    recall_target: float = RECALL_TARGET,
    threads: int | None = None,
    budget_s: float | None = None,
) -> ShardedBuild:
    """Build ``out`` (+ ``out.ivfdata``) over ``vectors`` (an (n, d) array or ``np.load(mmap_mode="r")``).

    ``work`` keeps the trained index and the shards between calls; with ``budget_s`` a call
    stops before starting a shard once that many seconds have passed (run it again to go on).
    """
    start = time.monotonic()
    n, dim = vectors.shape
    spec = parse_factory(factory or choose_factory(n, dim), dim)
    if not spec.is_ivf:
        raise ValueError(f"sharded builds need an IVF factory, got {spec.factory!r}")
    work.mkdir(parents=True, exist_ok=True)
    shards = [(a, min(a + shard_rows, n)) for a in range(0, n, shard_rows)]
    with faiss_threads(threads):
        trained = _trained(vectors, spec, work, seed=seed, max_train_vectors=max_train_vectors)
        done = 0
        for number, (a, b) in enumerate(shards):
            path = work / f"shard_{number:04d}.faiss"
            if not path.exists():
                if budget_s is not None and time.monotonic() - start > budget_s:
                    return ShardedBuild(None, done, len(shards))
                _add_shard(trained, vectors, a, b, path)
            done += 1
        index = faiss.read_index(str(work / "trained.faiss"))
        ivfdata = out.with_suffix(IVFDATA_SUFFIX)
        ivfdata.unlink(missing_ok=True)
        merge_ondisk(index, [str(work / f"shard_{i:04d}.faiss") for i in range(len(shards))], str(ivfdata))
        faiss.write_index(index, str(out))
        built = _tune(index, spec, vectors, queries, seed=seed, recall_target=recall_target)
    log.info("built %s over %d x %d vectors on disk: ANN recall@10 = %.4f (%s)",
             spec.factory, n, dim, built.ann_recall_at_10, built.search_params)
    return ShardedBuild(built, len(shards), len(shards))


def _trained(vectors: np.ndarray, spec: FactorySpec, work: Path, *, seed: int, max_train_vectors: int) -> faiss.Index:
    path = work / "trained.faiss"
    if path.exists():
        return faiss.read_index(str(path))
    index = faiss.index_factory(vectors.shape[1], spec.factory, faiss.METRIC_INNER_PRODUCT)
    if spec.kind == "ivf_pq":
        _faiss.downcast_index(index).do_polysemous_training = False
    rows = _sample(len(vectors), max(max_train_vectors, spec.min_vectors), seed)
    began = time.perf_counter()
    index.train(np.ascontiguousarray(vectors[rows], dtype=np.float32))
    log.info("trained %s on %d vectors in %.0f s", spec.factory, len(rows), time.perf_counter() - began)
    _write_atomic(index, path)
    return index


def _add_shard(trained: faiss.Index, vectors: np.ndarray, a: int, b: int, path: Path) -> None:
    began = time.perf_counter()
    shard = faiss.clone_index(trained)
    for s in range(a, b, 100_000):  # float32 copies of 100 k rows at a time
        e = min(s + 100_000, b)
        shard.add_with_ids(np.ascontiguousarray(vectors[s:e], dtype=np.float32), np.arange(s, e, dtype=np.int64))
    _write_atomic(shard, path)
    log.info("added rows %d-%d in %.0f s", a, b, time.perf_counter() - began)


def _write_atomic(index: faiss.Index, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    faiss.write_index(index, str(tmp))
    os.replace(tmp, path)


def _sample(n: int, count: int, seed: int) -> np.ndarray:
    if n <= count:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, count, replace=False))


def exact_top_k_streamed(vectors: np.ndarray, queries: np.ndarray, k: int, chunk: int = 500_000) -> np.ndarray:
    """(nq, k) exact inner-product scores, the rows read ``chunk`` at a time (memory-mapped input)."""
    heap = faiss.ResultHeap(len(queries), k, keep_max=True)
    for a in range(0, len(vectors), chunk):
        flat = faiss.IndexFlatIP(vectors.shape[1])
        flat.add(np.ascontiguousarray(vectors[a : a + chunk], dtype=np.float32))
        scores, rows = flat.search(queries, min(k, flat.ntotal))
        heap.add_result(scores, np.where(rows >= 0, rows + a, -1))
    heap.finalize()
    return heap.D


def recall_streamed(index: faiss.Index, vectors: np.ndarray, queries: np.ndarray, exact: np.ndarray,
                    params: dict[str, int], k: int = 10) -> float:
    """Tie-tolerant recall@k (as :func:`index.engines.faiss_index.ann_recall_at_k`) reading only the returned rows."""
    _, rows = search(index, queries, k, params=params)
    hits = 0
    for q, found in enumerate(rows):
        valid = np.unique(found[found >= 0])
        true_scores = np.asarray(vectors[valid], dtype=np.float32) @ queries[q]
        hits += min(int(np.sum(true_scores >= exact[q, -1] - TIE_TOLERANCE)), k)
    return hits / (k * len(queries))


def _tune(index: faiss.Index, spec: FactorySpec, vectors: np.ndarray, queries: np.ndarray | None, *,
          seed: int, recall_target: float) -> BuiltIndex:
    if queries is None:
        queries = vectors[_sample(len(vectors), RECALL_QUERIES, seed)]
    queries = np.ascontiguousarray(queries[:RECALL_QUERIES], dtype=np.float32)
    exact = exact_top_k_streamed(vectors, queries, 10)
    params = default_search_params(spec)
    apply_search_params(index, params)
    recall = recall_streamed(index, vectors, queries, exact, params)
    while recall < recall_target and params["nprobe"] < spec.nlist:
        params = {"nprobe": min(spec.nlist, 2 * params["nprobe"])}
        apply_search_params(index, params)
        recall = recall_streamed(index, vectors, queries, exact, params)
    return BuiltIndex(index=index, spec=spec, search_params=params, ann_recall_at_10=recall)


def build_and_save(vectors: np.ndarray, path: Path, factory: str | None = None, *,
                   queries: np.ndarray | None = None, ondisk_min_bytes: int = ONDISK_MIN_BYTES) -> BuiltIndex:
    """Build the index chosen by size and write it to ``path``: in memory (:func:`build_index`), or
    sharded with its lists in ``path.ivfdata`` when its codes exceed ``ondisk_min_bytes``."""
    from index.engines.faiss_index import build_index, save_index

    n, dim = vectors.shape
    spec = parse_factory(factory or choose_factory(n, dim), dim)
    if not use_ondisk(spec, n, dim, ondisk_min_bytes):
        built = build_index(vectors, spec.factory, queries=queries)
        save_index(built.index, path)
        return built
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".shards-") as work:
        result = build_sharded(vectors, path, spec.factory, work=Path(work), queries=queries)
    assert result.built is not None  # no budget: every shard is built
    return result.built
