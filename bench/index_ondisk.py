"""Benchmark: FAISS at 10 M × 256 on two cores — sharded IVF build with on-disk inverted lists.

The path `tonearm index` / `tonearm export` take when a collection's IVF codes exceed 2 GiB
(``index.engines.faiss_ondisk``). Resumable steps, state in ``--work``:

1. **vectors**: ``--n`` unit vectors of benchlib's mixture (1000 centres, noise 0.5; the same
   rows as ``benchlib.synthetic_vectors``) written to ``WORK/vectors.npy`` in 100 k slices;
2. **build**: :func:`index.engines.faiss_ondisk.build_sharded` — train on 100 k rows, add 1 M-row
   shards, merge the lists into ``WORK/index/audio.ivfdata``, tune ``nprobe`` to recall@10 ≥ 0.97
   on 1000 perturbed rows ("near");
3. **measure** (the call after the build, so a fresh process opens the index; the OS page
   cache is left as it is): recall@10 on 1000 fresh draws
   from the mixture against exact search (streamed), single-query searches/s on one thread
   and a 1000-query batch on every core, and the process's resident memory (anonymous and
   file-backed pages separately: the mapped lists count as file pages). The build's peak
   anonymous and file-backed RSS are sampled separately too (``RssSampler``): its kernel peak
   (VmHWM) counts the memory-mapped input vectors and list files, which the kernel can drop.

``--budget S`` stops between shards after S seconds so each ``quiet-run`` hold stays short;
run the same command again to go on. Seconds and peak RSS of every call are summed in
``WORK/timings.json``; the measure step writes docs/BENCHMARKS.md.

    quiet-run .venv/bin/python bench/index_ondisk.py --n 10000000 --work /var/tmp/ondisk10m --budget 480
    .venv/bin/python bench/index_ondisk.py --n 1000000 --work /tmp/ondisk1m   # validation, ~4 min
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

import faiss
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from index_scale import fresh_queries  # noqa: E402

from index.engines.faiss_index import (  # noqa: E402
    available_cores,
    faiss_threads,
    load_index,
    parse_factory,
    search,
)
from index.engines.faiss_ondisk import build_sharded, exact_top_k_streamed, recall_streamed  # noqa: E402

from benchlib import cpu_model, publish_section  # noqa: E402

MARKERS = "<!-- bench:index_ondisk_{size}:start -->", "<!-- bench:index_ondisk_{size}:end -->"
"""One section per size (1M, 10M), so validating at 1 M keeps the 10 M result."""
TARGETS = "build ≤ 30 min, recall@10 ≥ 0.90, memory ≤ 8 GB"
SLICE = 100_000


def write_vectors(path: Path, n: int, dim: int, seed: int) -> np.ndarray:
    """benchlib.synthetic_vectors' rows and near queries, normalized slice by slice into a .npy."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, dim)).astype(np.float32)
    tmp = path.with_suffix(".tmp.npy")
    x = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, dim))
    for start in range(0, n, SLICE):
        m = min(SLICE, n - start)
        part = centres[rng.integers(0, 1000, m)] + 0.5 * rng.standard_normal((m, dim)).astype(np.float32)
        x[start : start + m] = part / np.linalg.norm(part, axis=1, keepdims=True)
    x.flush()
    rows = np.sort(rng.choice(n, 1000, replace=False))
    q = x[rows] + 0.05 * rng.standard_normal((1000, dim)).astype(np.float32)
    del x
    os.replace(tmp, path)
    np.save(path.with_name("near.npy"), q / np.linalg.norm(q, axis=1, keepdims=True))
    return np.load(path, mmap_mode="r")


def rss() -> dict[str, float]:
    """Resident memory now (GB): anonymous and file-backed, from /proc/self/status."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kb = {k: int(fields[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM") if k in fields}
    return {k: v / 1e6 for k, v in kb.items()}


class RssSampler:
    """Peak anonymous and file-backed resident memory (GB) while the block runs, sampled from
    /proc/self/status every ``every_s`` (VmHWM, the kernel's peak, does not split the two: the
    mapped input vectors and list files are file pages the kernel can drop, anonymous ones not)."""

    def __init__(self, every_s: float = 0.2) -> None:
        self.every_s = every_s
        self.peak = {"RssAnon": 0.0, "RssFile": 0.0, "VmRSS": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = rss()
            for key in self.peak:
                self.peak[key] = max(self.peak[key], now.get(key, 0.0))
            self._stop.wait(self.every_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def record(work: Path, step: str, seconds: float, *, sampled: RssSampler | None = None, **extra: object) -> dict:
    path = work / "timings.json"
    timings = json.loads(path.read_text()) if path.exists() else {}
    entry = timings.setdefault(step, {"seconds": 0.0, "calls": 0, "peak_rss_gb": 0.0})
    entry["seconds"] += seconds
    entry["calls"] += 1
    entry["peak_rss_gb"] = max(entry["peak_rss_gb"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)
    if sampled is not None:  # peaks over every call (a resumed build is several)
        for key, name in (("RssAnon", "peak_anon_gb"), ("RssFile", "peak_file_gb")):
            entry[name] = max(float(entry.get(name, 0.0)), sampled.peak[key])
    entry.update(extra)
    path.write_text(json.dumps(timings, indent=1))
    return timings


def build(args: argparse.Namespace) -> bool:
    """Steps 1–2; True once the index is complete."""
    args.work.mkdir(parents=True, exist_ok=True)
    vectors_path = args.work / "vectors.npy"
    if not vectors_path.exists():
        began = time.perf_counter()
        write_vectors(vectors_path, args.n, args.dim, args.seed)
        record(args.work, "vectors", time.perf_counter() - began)
    vectors = np.load(vectors_path, mmap_mode="r")
    out = args.work / "index" / "audio.faiss"
    out.parent.mkdir(exist_ok=True)
    if (args.work / "built.json").exists():
        return True
    began = time.perf_counter()
    with RssSampler() as sampled:
        result = build_sharded(vectors, out, args.factory, work=args.work / "shards",
                               queries=np.load(args.work / "near.npy"), budget_s=args.budget)
    print(f"shards {result.shards_done}/{result.shards_total}", flush=True)
    if result.built is None:
        record(args.work, "build", time.perf_counter() - began, sampled=sampled)
        return False
    built = result.built
    record(args.work, "build", time.perf_counter() - began, sampled=sampled)
    (args.work / "built.json").write_text(json.dumps({
        "factory": built.spec.factory, "params": built.search_params, "near": built.ann_recall_at_10,
    }))
    return True


def measure(args: argparse.Namespace) -> dict:
    """Step 3 in this (fresh) process: open cold, recall on fresh queries, throughput, memory."""
    built = json.loads((args.work / "built.json").read_text())
    vectors = np.load(args.work / "vectors.npy", mmap_mode="r")
    began = time.perf_counter()
    index = load_index(args.work / "index" / "audio.faiss", spec=parse_factory(built["factory"], args.dim),
                       search_params=built["params"])
    opened = time.perf_counter() - began
    fresh = fresh_queries(1000, args.dim, args.seed)
    params = built["params"]
    with faiss_threads(1):
        start = time.perf_counter()
        for i in range(200):  # cold: the first searches read their lists from disk
            search(index, fresh[i : i + 1], 10, params=params)
        single = 200 / (time.perf_counter() - start)
    with faiss_threads():
        start = time.perf_counter()
        search(index, fresh, 10, params=params)
        batch = 1000 / (time.perf_counter() - start)
        memory = rss()
        exact = exact_top_k_streamed(vectors, fresh, 10)
        fresh_recall = recall_streamed(index, vectors, fresh, exact, params)
    return {"open_s": opened, "single": single, "batch": batch, "fresh": fresh_recall, "memory": memory,
            **built}


def markdown(result: dict, timings: dict, *, work: Path, n: int, dim: int, command: str, load: str) -> str:
    start, end = (m.format(size=f"{n / 1e6:g}M") for m in MARKERS)
    build_s = timings["build"]["seconds"]
    peak = max(t["peak_rss_gb"] for t in timings.values())
    anon, file = (timings["build"].get(k) for k in ("peak_anon_gb", "peak_file_gb"))
    split = f"{anon:.2f} / {file:.2f}" if anon is not None and file is not None else "not sampled"
    mem = result["memory"]
    ivfdata = sum(p.stat().st_size for p in (work / "index").glob("*"))
    params = ", ".join(f"{k}={v}" for k, v in result["params"].items())
    return "\n".join([
        start,
        f"## index_ondisk — FAISS at {n / 1e6:g} M × {dim}: sharded build, lists on disk (bench/index_ondisk.py)",
        "",
        f"- command: `{command}` (run until complete; {timings['build']['calls']} build calls)",
        f"- machine: {cpu_model()}, {available_cores()} cores, faiss {faiss.__version__}",
        f"- date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; load at start of each call: {load}",
        f"- data: benchlib's mixture (1000 centres, noise 0.5); recall@10 vs exact (tie-tolerant) on 1000 "
        f"perturbed rows (near, what nprobe is tuned on) and 1000 fresh draws (fresh). Targets: {TARGETS}.",
        "",
        "| factory | build (s) | vectors (s) | search params | recall@10 near | recall@10 fresh | index files (GB) "
        "| peak RSS, build (GB) | build peaks: anon / file (GB) | RSS after searches: anon / file (GB) | open (s) "
        "| single q/s (cold, 1 thread) | batch q/s |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {result['factory']} | {build_s:.0f} | {timings.get('vectors', {}).get('seconds', 0):.0f} | {params} "
        f"| {result['near']:.3f} | {result['fresh']:.3f} | {ivfdata / 1e9:.2f} | {peak:.2f} | {split} "
        f"| {mem.get('RssAnon', 0):.2f} / {mem.get('RssFile', 0):.2f} | {result['open_s']:.2f} "
        f"| {result['single']:,.0f} | {result['batch']:,.0f} |",
        end,
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--factory", help="IVF factory (default: chosen by size)")
    parser.add_argument("--work", type=Path, required=True, help="state between calls (~2.1 GB per million vectors)")
    parser.add_argument("--budget", type=float, help="stop between shards after this many seconds (resume later)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    load = f"{os.getloadavg()[0]:.1f}"
    loads = args.work / "loads.txt"
    args.work.mkdir(parents=True, exist_ok=True)
    with loads.open("a") as handle:
        handle.write(load + "\n")
    if not (args.work / "built.json").exists():
        done = build(args)
        print("built: run the same command again to measure (a fresh process opens the index cold)" if done
              else "not complete: run the same command again", flush=True)
        return 0
    result = measure(args)
    timings = json.loads((args.work / "timings.json").read_text())
    print(json.dumps(result, indent=1), flush=True)
    command = "quiet-run .venv/bin/python bench/index_ondisk.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = markdown(result, timings, work=args.work, n=args.n, dim=args.dim, command=command.strip(),
                       load=", ".join(loads.read_text().split()))
    start, end = (m.format(size=f"{args.n / 1e6:g}M") for m in MARKERS)
    publish_section(section, start=start, end=end, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
