"""Benchmark: added items kept in Milvus (:class:`index.milvus_items.MilvusItemStore`, issue 47 part 5).

* **Server**: a Milvus 2.3.5 standalone server (tests/milvus_server.py) on a fresh data directory.
* **Items**: ``--sizes`` random unit vectors (``--dim``), each with realistic metadata (``license``
  of 4 values, ``duration``, 1–3 ``tags``, and ``bucket`` uniform in 0…9999, which sets a filter's
  selectivity exactly: ``bucket < 5000`` 50 %, ``< 100`` 1 %, ``< 1`` 0.01 %).
* **Ingest**: ``put`` batches of ``--batch`` items, each flushed before it returns (the store's
  durability): items/s over the whole ingest.
* **Search**: ``--queries`` queries one at a time, k = 10, unfiltered and at each selectivity:
  p50/p99 latency (Strong reads) and recall@10 against exact numpy search over the same vectors and
  mask (the bench keeps the vectors). Index ``--index`` (HNSW by default; FLAT is exact).

Not measured here (yet): the overlay design on FAISS at the same sizes. Prints a table and, unless
``--no-write``, writes (or replaces) the ``milvus_items`` section of docs/BENCHMARKS.md.

    flock /tmp/tonearm-heavy.lock python bench/milvus_items.py --sizes 1000000      # the issue's size
    python bench/milvus_items.py --sizes 20000 --queries 50 --no-write              # smoke, ~1 min
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench.benchlib import cpu_model, publish_section  # noqa: E402

START, END = "<!-- bench:milvus_items:start -->", "<!-- bench:milvus_items:end -->"
LICENSES = ("cc0", "cc-by", "cc-by-nc", "proprietary")
TAGS = ("rain", "wind", "night", "city", "birds", "sea", "crowd", "engine")
SELECTIVITY = {"none": None, "50 %": 5000, "1 %": 100, "0.01 %": 1}


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def run(n: int, args: argparse.Namespace, uri: str) -> list[str]:
    from index.filters import parse_filter
    from index.milvus_index import MilvusTarget
    from index.milvus_items import MilvusItemStore

    rng = np.random.default_rng(n)
    target = MilvusTarget(uri=uri, prefix=f"bench{n}", timeout_s=30.0, bulk_timeout_s=600.0)
    store = MilvusItemStore(target, dim=args.dim, index_type=args.index).open()
    vectors = np.empty((n, args.dim), np.float32)
    buckets = rng.integers(0, 10_000, size=n)
    started = time.perf_counter()
    for start in range(0, n, args.batch):
        stop = min(n, start + args.batch)
        chunk = _unit(rng, stop - start, args.dim)
        vectors[start:stop] = chunk
        store.put([(f"item-{i:08d}", chunk[i - start], {
            "license": LICENSES[i % 4], "duration": float(1 + (i * 7919) % 300) / 10,
            "tags": sorted({TAGS[(i * p) % len(TAGS)] for p in (1, 3, 5)[: 1 + i % 3]}),
            "bucket": int(buckets[i])}) for i in range(start, stop)])
    ingest_s = time.perf_counter() - started
    queries = _unit(np.random.default_rng(1), args.queries, args.dim)
    rows = []
    for name, below in SELECTIVITY.items():
        flt = None if below is None else parse_filter({"bucket": {"lt": below}})
        mask = np.ones(n, bool) if below is None else buckets < below
        allowed = np.flatnonzero(mask)
        times, recalls = [], []
        store.search(queries[:1], 10, flt)  # warm (loads, first plan)
        for q in queries:
            t0 = time.perf_counter()
            _, ids = store.search(q[None, :], 10, flt)
            times.append(time.perf_counter() - t0)
            scores = vectors[allowed] @ q
            exact = {f"item-{int(allowed[j]):08d}" for j in np.argsort(-scores)[:10]}
            recalls.append(len(exact & set(ids[0])) / max(1, len(exact)))
        p50, p99 = np.percentile(np.array(times) * 1000, [50, 99])
        rows.append(f"| {n:,} | {args.dim} | {args.index} | {n / ingest_s:,.0f} | {name} | {len(allowed):,} "
                    f"| {p50:.1f} | {p99:.1f} | {np.mean(recalls):.3f} |")
        print(rows[-1], flush=True)
    store.drop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000", help="comma-separated numbers of items")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--index", default="HNSW", choices=("FLAT", "HNSW", "IVF_FLAT", "AUTOINDEX"))
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    from tests.milvus_server import MilvusStandalone

    lines = []
    with tempfile.TemporaryDirectory(prefix="milvus-items-") as work:
        server = MilvusStandalone(Path(work) / "milvus")
        server.start()
        try:
            for n in (int(s) for s in args.sizes.split(",")):
                lines += run(n, args, server.uri)
        finally:
            server.kill()
    section = "\n".join([
        START,
        "### Added items in Milvus (`bench/milvus_items.py`)",
        "",
        f"- CPU: {cpu_model()}, {os.cpu_count()} cores; load before the run: {os.getloadavg()[0]:.2f}; "
        "server: Milvus 2.3.5 standalone (tests/milvus_server.py), fresh data directory, on the same machine "
        "as the client.",
        f"- ingest: `put` batches of {args.batch}, each flushed; search: {args.queries} queries one at a time, "
        "k = 10, Strong reads; recall@10 against exact numpy search with the same mask. Filter "
        "`{\"bucket\": {\"lt\": …}}` at each selectivity.",
        "",
        "| items | dim | index | ingest items/s | filter selectivity | passing items | p50 ms | p99 ms | recall@10 |",
        "|---|---|---|---|---|---|---|---|---|",
        *lines,
        "",
        "Random unit vectors in 512 d have no cluster structure, a hard case for HNSW: the recall above is "
        "with the backend's search `ef = max(64, k)` (index/milvus_index.py `search_params`); recall on real "
        "embeddings and with a larger `ef` is not measured here.",
        END,
    ])
    publish_section(section, start=START, end=END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
