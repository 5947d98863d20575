"""Moment search at 10 h, 100 h and 1,000 h of recordings spread over many recordings (issue 54, part 4;
docs/BENCHMARKS.md "moments_scale").

The catalogue: recordings of 2–60 min (uniform), windows of ``--window`` s every half window (the demo
bundle's: 5-s windows, 256-d), synthetic unit vectors — each recording's background around one of 200
shared topics (clustered, as field recordings of one place are), and one planted event of 2–8 windows around
a vector of its own, so the top moment of a query near that event vector is well defined. Written as a
bundle's ``moments/windows.npy`` + ``spans.npy``.

Backends, each searched from its own process (its RSS is what one replica holds):
``exact`` (:class:`index.moments.windows.ExactWindows`, in memory), ``faiss``
(:class:`index.moments.faiss_windows.FaissWindows`: IVF-PQ over the memory-mapped windows) and ``milvus``
(:class:`index.engines.milvus_windows.MilvusWindows` on a Milvus 2.3.5 standalone server started here as the
tests start it — the windows written as `tonearm bundle publish` writes them, index type by size; the replica
holds none). Each query runs :func:`index.moments.sources.search_sources` (candidates, the k best recordings'
windows read, the sliding-window post-processing) at k = 10 and 100: p50/p99, the replica's peak RSS, the
index build time, and the recall of the top moment against the exact source (same recording, IoU ≥ 0.5).

    flock /tmp/tonearm-heavy.lock python bench/moments_scale.py [--hours 10 100 1000] [--queries 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.benchlib import cpu_model, publish_section  # noqa: E402

START, END = "<!-- bench:moments_scale:start -->", "<!-- bench:moments_scale:end -->"
TOPICS = 200
TARGET_P99_MS, TARGET_RSS_MB = 50.0, 300.0
KS = (10, 100)


# ----------------------------------------------------------------------------- the catalogue


def build_catalogue(root: Path, hours: float, *, dim: int, window: float, seed: int = 0) -> dict:
    """Write ``root/moments/{windows,spans}.npy`` and ``root/events.json`` (each recording's event span and
    vector seed); returns the summary. Cached: an existing catalogue of the same parameters is reused."""
    summary_path = root / "catalogue.json"
    wanted = {"hours": hours, "dim": dim, "window": window, "seed": seed}
    if summary_path.is_file() and json.loads(summary_path.read_text())["params"] == wanted:
        return json.loads(summary_path.read_text())
    from index.moments.postprocess import window_spans

    rng = np.random.default_rng(seed)
    topics = rng.standard_normal((TOPICS, dim)).astype(np.float32)
    lengths = []
    total = 0.0
    while total < hours * 3600:
        lengths.append(float(rng.uniform(120, 3600)))
        total += lengths[-1]
    tables = [window_spans(seconds, window, window / 2) for seconds in lengths]
    n = sum(len(t) for t in tables)
    (root / "moments").mkdir(parents=True, exist_ok=True)
    vectors = np.lib.format.open_memmap(root / "moments" / "windows.npy", mode="w+", dtype=np.float32, shape=(n, dim))
    spans = np.zeros((n, 3))
    events, at = [], 0
    for row, table in enumerate(tables):
        m = len(table)
        block = topics[rng.integers(TOPICS)] + 1.2 * rng.standard_normal((m, dim)).astype(np.float32)
        width = int(rng.integers(2, 9))
        first = int(rng.integers(0, max(1, m - width)))
        event = rng.standard_normal(dim).astype(np.float32)
        event /= np.linalg.norm(event)
        block[first : first + width] = 4.0 * event * np.sqrt(dim) / 8 + 0.3 * rng.standard_normal((width, dim))
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        vectors[at : at + m] = block
        spans[at : at + m] = np.column_stack([np.full(m, row, np.float64), table])
        events.append({"row": row, "start": float(table[first, 0]), "end": float(table[min(m, first + width) - 1, 1]),
                       "vector": event.tolist()})
        at += m
    vectors.flush()
    del vectors
    np.save(root / "moments" / "spans.npy", spans)
    (root / "events.json").write_text(json.dumps(events))
    summary = {"params": wanted, "recordings": len(tables), "windows": n, "hours": total / 3600}
    summary_path.write_text(json.dumps(summary))
    return summary


def queries_for(root: Path, count: int, seed: int = 1) -> np.ndarray:
    """``count`` queries near the planted events of random recordings (noise 0.35 · √(1/d) per component)."""
    events = json.loads((root / "events.json").read_text())
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(events), size=min(count, len(events)), replace=False)
    dim = len(events[0]["vector"])
    q = np.array([events[i]["vector"] for i in picked], np.float32)
    q += 0.35 * rng.standard_normal(q.shape).astype(np.float32) / np.sqrt(dim)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


# ----------------------------------------------------------------------------- one replica (a subprocess)


def _rss_mb() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MB: ``VmRSS`` and ``VmHWM`` — not ``ru_maxrss``, which Linux
    carries across exec from the forked copy of the parent (the bench process, holding the catalogue)."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            found[line[:5]] = int(line.split()[1]) / 1024
    return found["VmRSS"], found["VmHWM"]


def serve(args: argparse.Namespace) -> None:
    """Open one backend's source, run every query at each k, print one JSON line."""
    from index.moments.sources import WindowSource, search_sources

    root = Path(args.root)
    queries = np.load(args.queries)
    opened = time.perf_counter()
    source: WindowSource
    if args.backend == "exact":
        from index.moments.windows import ExactWindows

        source = ExactWindows.load(root)
    elif args.backend == "faiss":
        from index.moments.faiss_windows import FaissWindows

        source = FaissWindows(root, cache_dir=root / ".moment-index")
    else:
        from index.engines.milvus_index import MilvusTarget
        from index.engines.milvus_windows import bundle_windows

        source = bundle_windows(MilvusTarget(uri=args.uri, timeout_s=30.0), args.bundle_id, json.loads(args.info))
    open_s = time.perf_counter() - opened
    out: dict = {"backend": args.backend, "open_s": round(open_s, 2), "build_s": getattr(source, "build_seconds", None)}
    for k in KS:
        search_sources(queries[0], k, [source])  # warm: first-touch of mapped pages, connections
        times, tops = [], []
        for query in queries:
            began = time.perf_counter()
            hits = search_sources(query, k, [source])
            times.append(1000 * (time.perf_counter() - began))
            tops.append([int(hits[0].key), hits[0].start, hits[0].end] if hits else None)
        out[f"k{k}"] = {"p50": float(np.percentile(times, 50)), "p99": float(np.percentile(times, 99)), "tops": tops,
                        "peak_rss_mb": _rss_mb()[1]}
    out["rss_mb"], out["peak_rss_mb"] = _rss_mb()
    print(json.dumps(out))  # noqa: T201


def run_replica(backend: str, root: Path, queries: Path, **extra: str) -> dict:
    cmd = [sys.executable, __file__, "_serve", "--backend", backend, "--root", str(root), "--queries", str(queries)]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", value]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=7200)
    if done.returncode != 0:
        raise SystemExit(f"{backend} replica failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- Milvus


def publish_to_milvus(root: Path, uri: str, bundle_id: str, dim: int) -> dict:
    """The windows written as `tonearm bundle publish` writes them (:func:`publish_windows`); its registry entry."""
    from index.engines.milvus_index import MilvusTarget
    from index.engines.milvus_windows import publish_windows

    target = MilvusTarget(uri=uri, bulk_timeout_s=1800.0)
    manifest = SimpleNamespace(moments=SimpleNamespace(windows_file="moments/windows.npy",
                                                       spans_file="moments/spans.npy", n_windows=1),
                               bundle_id=bundle_id, embed_dim=dim)
    began = time.monotonic()
    info = publish_windows(root, manifest, np.zeros((0, dim), np.float32), target=target,
                           progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))["windows"]
    info["publish_s"] = round(time.monotonic() - began, 1)
    return info


def top_recall(reference: list, found: list, events_overlap: float = 0.5) -> float:
    """Share of queries whose top moment is the exact source's: same recording, temporal IoU ≥ 0.5."""
    same = 0
    for ref, got in zip(reference, found, strict=True):
        if ref is None or got is None or ref[0] != got[0]:
            continue
        inter = max(0.0, min(ref[2], got[2]) - max(ref[1], got[1]))
        union = (ref[2] - ref[1]) + (got[2] - got[1]) - inter
        same += inter / union >= events_overlap if union > 0 else 0
    return same / len(reference)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("_serve")
    for name in ("backend", "root", "queries", "uri", "bundle-id", "info"):
        one.add_argument(f"--{name}")
    parser.add_argument("--hours", type=float, nargs="+", default=[10.0, 100.0, 1000.0])
    parser.add_argument("--backends", nargs="+", default=["exact", "faiss", "milvus"])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--dim", type=int, default=256, help="the demo bundle's embedding width")
    parser.add_argument("--window", type=float, default=5.0, help="the demo bundle's clip_seconds (hop: half)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tonearm-moments-scale")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.command == "_serve":
        serve(args)
        return 0

    load = os.getloadavg()[0]
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    server = None
    stored = args.work / "rows.json"  # rows of earlier runs in this work directory: a rerun of some replaces them
    rows = json.loads(stored.read_text()) if stored.is_file() else []
    command = " ".join(sys.argv[1:])
    try:
        for hours in args.hours:
            root = args.work / f"h{hours:g}"
            began = time.monotonic()
            summary = build_catalogue(root, hours, dim=args.dim, window=args.window)
            print(f"{hours:g} h: {summary['recordings']:,} recordings, {summary['windows']:,} windows "
                  f"({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
            queries = root / "queries.npy"
            np.save(queries, queries_for(root, args.queries))
            results = {"exact": run_replica("exact", root, queries)}
            for backend in ["exact", *[b for b in args.backends if b != "exact"]]:
                if backend == "faiss":
                    results["faiss"] = run_replica("faiss", root, queries)
                elif backend == "milvus":
                    if server is None:
                        from tests.milvus_server import MilvusStandalone

                        server = MilvusStandalone(args.work / "milvus")
                        server.start()
                    bundle_id = f"scale-{hours:g}h"
                    info = publish_to_milvus(root, server.uri, bundle_id, args.dim)
                    results["milvus"] = run_replica("milvus", root, queries, uri=server.uri, bundle_id=bundle_id,
                                                    info=json.dumps(info))
                    results["milvus"]["build_s"] = info["build_s"]
                    results["milvus"]["index"] = info["index_type"]
                got = results[backend]
                row = {"hours": hours, "recordings": summary["recordings"], "windows": summary["windows"],
                       "backend": backend, "index": got.get("index", {"exact": "in memory", "faiss": "IVF-PQ"}.get(backend)),
                       "build_s": got.get("build_s"), "peak_rss_mb": got["peak_rss_mb"], "rss_mb": got["rss_mb"],
                       "open_s": got["open_s"]}
                for k in KS:
                    row[f"p50_k{k}"], row[f"p99_k{k}"] = got[f"k{k}"]["p50"], got[f"k{k}"]["p99"]
                    row[f"recall_k{k}"] = top_recall(results["exact"][f"k{k}"]["tops"], got[f"k{k}"]["tops"])
                row["run"] = f"`{command}` ({started}, load {load:.2f} at its start)"
                rows = [r for r in rows if (r["hours"], r["backend"]) != (hours, backend)] + [row]
                rows.sort(key=lambda r: (r["hours"], ["exact", "faiss", "milvus"].index(r["backend"])))
                stored.write_text(json.dumps(rows))
                print(json.dumps(row), file=sys.stderr, flush=True)
                # after each row: a run stopped later (the 1,000-h build is long) keeps what it measured
                publish_section(render(rows, args, load, started), start=START, end=END, write=not args.no_write)
    finally:
        if server is not None:
            server.kill()
    return 0


def render(rows: list[dict], args: argparse.Namespace, load: float, started: str) -> str:
    runs = list(dict.fromkeys(r["run"] for r in rows))
    lines = [START, "## moments_scale: moment search at 10–1,000 h over many recordings (issue 54, part 4)", "",
             f"`flock /tmp/tonearm-heavy.lock python bench/moments_scale.py ARGS` on {cpu_model()} "
             f"({os.cpu_count()} cores, shared with other sessions), runs: " + "; ".join(
                 f"({i + 1}) {run}" for i, run in enumerate(runs)) + f". Recordings of 2–60 min, {args.window:g}-s windows every {args.window / 2:g} s "
             f"(the demo bundle's), {args.dim}-d synthetic vectors (200 shared topics, one planted event per recording), "
             f"{args.queries} queries near planted events; each backend searched from its own process "
             "(`search_sources`: candidates, the k best recordings' windows — on Milvus stretches around their hot "
             "windows and a sample, not whole recordings —, the sliding-window post-processing of runs that can rank). "
             "Recall: the top moment equals the exact source's (same recording, IoU ≥ 0.5). RSS: the searching "
             "process's, after the queries / at its peak (Python, numpy and the client libraries included: importing "
             "pymilvus alone costs ~80 MB, a process that imported it and this library ~170 MB before any window). "
             "Open: the replica's start (loading, mapping or connecting; the FAISS index read from its cache once built).", "",
             "| run | hours | recordings | windows | backend | index | build (s) | p50 / p99 k=10 (ms) | p50 / p99 k=100 (ms) "
             "| top-moment recall k=10 / 100 | replica RSS / peak (MB) | open (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        build = f"{r['build_s']:.0f}" if r.get("build_s") else "—"
        peak = f"{r['peak_rss_mb']:.0f}" if r.get("peak_rss_mb") is not None else "—"
        lines.append(f"| {runs.index(r['run']) + 1} | {r['hours']:g} | {r['recordings']:,} | {r['windows']:,} | {r['backend']} | {r['index']} | {build} "
                     f"| {r['p50_k10']:.1f} / {r['p99_k10']:.1f} | {r['p50_k100']:.1f} / {r['p99_k100']:.1f} "
                     f"| {r['recall_k10']:.3f} / {r['recall_k100']:.3f} | {r['rss_mb']:.0f} / {peak} "
                     f"| {r['open_s']:.1f} |")
    lines += ["", verdict(rows), "", LIMITS, "", END]
    return "\n".join(lines) + "\n"


LIMITS = (
    "**What limits it.** The post-processing is bounded by what can rank (`index/moments/sources.py`): only the "
    "k best recordings are read, only runs peaking at or above the k-th one's best window are refined (on these "
    "noisy curves refining every run was most of a query: the exact source's k = 10 at 10 h went from 38 to "
    "6 ms p50), and on Milvus a recording is read as stretches of 16-window parts around its hot windows plus "
    "a 64-window sample for its background instead of whole (~740 windows, ~0.4 MB each at float16): at 100 h "
    "a query went from 70 to 19 ms p50; at 1,000 h from 71 / 147 to 26 / 43 ms p50 / p99 at k = 10. The "
    "bounded reads alone do not move the top moment (an in-memory source with the same layout: recall 1.00 at "
    "100 h and 1,000 h, edges within 0.02 s). What is left on Milvus: the candidate search, which is also what "
    "limits the recall — an event's few windows lie far from the rest of the graph, and at HNSW ef 1024 the "
    "search misses the top recording for 11–18 % of these queries (ef 2048: 3 %, 37 ms p50; 4096: 1 %, 59 ms; "
    "8192: none, 119 ms; measured on the same 1,000-h collection, `HNSW_EF` in "
    "`index/engines/milvus_windows.py`): on this machine — two cores shared by the Milvus server and the "
    "replica — the 50-ms target holds only at the recall shown. At k = 100 the candidate search runs up to "
    "four rounds of a doubling window count and the hot windows need a search of their own (its rounds do not "
    "reach the floor), so k = 100 stays at ~200–400 ms: a Milvus with group-by search (2.4+) would find the "
    "k recordings in one call. At 10 h (22 recordings of ~700 windows) the Milvus search is slower than at "
    "100 h: the first 80 windows come from few recordings, so more rounds run and the hot windows need their "
    "own search. The trained head still reads its recordings whole."
)


def verdict(rows: list[dict]) -> str:
    """Whether the 1,000-h Milvus row meets the target (p99 ≤ 50 ms at both k, ≤ 300 MB per replica)."""
    found = [r for r in rows if r["backend"] == "milvus" and r["hours"] == 1000]
    if not found:
        return "**Target** (1,000 h on Milvus: p99 ≤ 50 ms, ≤ 300 MB per replica): not measured in these runs."
    r = found[0]
    p99 = {k: r[f"p99_k{k}"] for k in KS}
    met_time = {k: p99[k] <= TARGET_P99_MS for k in KS}
    peak = r.get("peak_rss_mb")
    met_memory = (peak if peak is not None else r["rss_mb"]) <= TARGET_RSS_MB
    said = ", ".join(f"k = {k}: p99 {p99[k]:.0f} ms ({'met' if met_time[k] else 'not met'})" for k in KS)
    return (f"**Target** (1,000 h on Milvus: p99 ≤ {TARGET_P99_MS:g} ms, ≤ {TARGET_RSS_MB:g} MB per replica): {said}; "
            f"replica RSS {r['rss_mb']:.0f} MB after the queries, "
            f"{f'{peak:.0f} MB at its peak' if peak is not None else 'its peak not measured in that run'} "
            f"({'met' if met_memory else 'not met'}; the replica holds no window: its RSS is the process, the client "
            "and one query's windows in flight).")


if __name__ == "__main__":
    raise SystemExit(main())
