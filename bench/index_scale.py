"""Benchmark: FAISS indices at a million vectors — build time, ANN recall@10, query throughput vs exact.

``--n`` synthetic unit vectors (default 1 M × 256, clustered around 1000 centres, the
generator of bench/export.py) are indexed with the export code path
(``index.engines.faiss_index.build_index``: the factory chosen by size unless ``--factory`` is
given, every core, IVF ``nprobe`` tuned to the recall target). Recall@10 is measured
against exact search (tie-tolerant) on two query sets: perturbed database rows
("near", what ``build_index`` tunes on) and fresh draws from the same mixture
("fresh": their neighbours are farther and closer together, so harder). Throughput:
single-query searches on one thread (what one request costs) and one batch of all
queries on every core (what a micro-batch costs), each against exact ``Flat`` search
over the same vectors.

    OMP_NUM_THREADS=2 python bench/index_scale.py                      # ~2-4 min, writes docs/BENCHMARKS.md
    python bench/index_scale.py --n 200000 --factory HNSW32,Flat --no-write
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path

import faiss
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from index.engines.faiss_index import (  # noqa: E402
    ann_recall_at_k,
    available_cores,
    build_index,
    choose_factory,
    exact_top_k,
    faiss_threads,
    search,
)

from benchlib import cpu_model, publish_section, synthetic_vectors  # noqa: E402

START, END = "<!-- bench:index_scale:start -->", "<!-- bench:index_scale:end -->"
SINGLE_QUERIES = 200
TARGETS = "build ≤ 300 s, recall@10 ≥ 0.95, ≥ 10× exact single-query throughput"


def fresh_queries(n: int, dim: int, seed: int) -> np.ndarray:
    """New points from the benchmark's mixture (same centres as ``synthetic_vectors``)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, dim)).astype(np.float32)
    q = centres[np.random.default_rng(seed + 1).integers(0, 1000, n)]
    q = q + 0.5 * np.random.default_rng(seed + 2).standard_normal(q.shape).astype(np.float32)
    return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def throughput(index: faiss.Index, queries: np.ndarray, params: dict[str, int]) -> tuple[float, float]:
    """(single-query searches/s on one thread, batched queries/s on every core)."""
    with faiss_threads(1):
        search(index, queries[:2], 10, params=params)
        start = time.perf_counter()
        for i in range(SINGLE_QUERIES):
            search(index, queries[i : i + 1], 10, params=params)
        single = SINGLE_QUERIES / (time.perf_counter() - start)
    with faiss_threads():
        start = time.perf_counter()
        search(index, queries, 10, params=params)
        batch = len(queries) / (time.perf_counter() - start)
    return single, batch


def run(args: argparse.Namespace) -> list[dict]:
    vectors, near = synthetic_vectors(args.n, args.dim, args.seed)
    fresh = fresh_queries(1000, args.dim, args.seed)
    factories = args.factory or [choose_factory(args.n, args.dim)]
    rows = []
    for factory in ["Flat", *factories]:
        start = time.perf_counter()
        built = build_index(vectors, factory, queries=near)
        seconds = time.perf_counter() - start
        with faiss_threads():
            fresh_recall = ann_recall_at_k(
                built.index, vectors, fresh, k=10, params=built.search_params,
                exact_scores=exact_top_k(vectors, fresh, 10),
            ) if factory != "Flat" else 1.0
        single, batch = throughput(built.index, fresh, built.search_params)
        rows.append({"factory": factory, "seconds": seconds, "params": built.search_params,
                     "near": built.ann_recall_at_10, "fresh": fresh_recall, "single": single, "batch": batch})
        print(rows[-1], flush=True)
        del built
    return rows


def markdown(rows: list[dict], *, command: str, n: int, dim: int, load: tuple[float, float]) -> str:
    flat = rows[0]
    lines = [
        START,
        "## index_scale — FAISS at a million vectors: build, recall, throughput (bench/index_scale.py)",
        "",
        f"- command: `{command}`",
        f"- machine: {cpu_model()}, {available_cores()} cores, faiss {faiss.__version__}; builds on every core",
        f"- date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; 1-min load average before / after: "
        f"{load[0]:.1f} / {load[1]:.1f} (other jobs share the machine)",
        f"- data: {n:,} × {dim} unit vectors around 1000 centres (noise-to-signal 0.5); recall@10 vs exact, "
        "tie-tolerant, on 1000 perturbed database rows (near; what the build tunes nprobe on) and 1000 fresh "
        "draws from the mixture (fresh); single = one query per call on one thread; batch = 1000 queries "
        f"in one call on every core. Targets: {TARGETS}.",
        "",
        "| factory | build (s) | vectors/s | search params | recall@10 near | recall@10 fresh "
        "| single q/s | × exact | batch q/s | × exact |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "—"
        lines.append(
            f"| {r['factory']} | {r['seconds']:.1f} | {n / r['seconds']:,.0f} | {params} | {r['near']:.3f} "
            f"| {r['fresh']:.3f} | {r['single']:,.0f} | {r['single'] / flat['single']:.1f} "
            f"| {r['batch']:,.0f} | {r['batch'] / flat['batch']:.1f} |"
        )
    lines.append(END)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--factory", action="append", help="factory to compare (repeatable; default: by size)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    before = os.getloadavg()[0]
    rows = run(args)
    command = "OMP_NUM_THREADS=2 python bench/index_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = markdown(rows, command=command.strip(), n=args.n, dim=args.dim, load=(before, os.getloadavg()[0]))
    publish_section(section, start=START, end=END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
