"""Benchmark: where each design of added items stops (issue 47 part 5) — the items in Milvus
(:class:`index.items.milvus_store.MilvusItemStore`, the Milvus backend) beside the file log and in-memory
overlay of the FAISS backend (:mod:`index.items.log` + :mod:`index.items.overlay`), on the same items,
metadata and queries.

* **Items**: item ``i`` is the same in both designs and at every size: a random unit vector
  (``--dim``; chunks of 10,000 rows, each from its own seed) with realistic metadata (``license`` of
  4 values, ``duration``, 1–3 ``tags``, and ``bucket`` uniform in 0…9999, which sets a filter's
  selectivity exactly: ``bucket < 5000`` 50 %, ``< 100`` 1 %, ``< 1`` 0.01 %).
* **Queries**: the same random unit vectors for both designs, k = 10, one at a time, unfiltered
  and with ``{"bucket": {"lt": …}}`` at each selectivity: p50/p99 latency and recall@10 against an
  exact numpy search over the same vectors and mask. Each cell runs ``--queries`` queries or as many
  as fit in ``--cell-seconds`` (at least ``--min-queries``): the table says how many.
* **Milvus** (``--milvus-sizes``, a fresh Milvus 2.3.5 standalone server from tests/milvus_server.py,
  or ``--milvus-uri``): ``put`` batches of ``--batch`` items (each flushed before it returns, the
  store's durability), then the wait until the index covers every row (``--index``: HNSW builds in
  the background); search through ``MilvusItemStore.search`` as the store is called by default (a
  Strong read of the store's field kinds, then a Strong search with the filter pushed down as a JSON
  expression); the server's RSS (its process group) after the queries.
* **Overlay** (``--overlay-sizes``, one log grown through the sizes): ``ItemLog.put`` of every item
  (stored audio and record fsync'd, as ``POST /v1/items:batch`` does) in batches of the route's
  ``ITEMS_BATCH_MAX``, each batch then applied with :func:`index.items.overlay.build_overlay` — the
  writer's path of ``service/items.py`` with the embedding replaced by the precomputed vectors (the
  ``embed_audio`` callable the service passes runs the bundle's encoder there). Stored audio is a
  32-byte placeholder per item: the write of a real upload (~160 KiB for 5 s of 16 kHz WAV) and its
  embedding are not in these numbers. Search as ``service.searcher.Searcher`` does for added items:
  the filter's mask over the overlay's metadata table, then :meth:`ItemOverlay.search_items` (exact).
  **Startup**: a fresh process replays the log into an overlay, as a replica does at start (its
  vectors read from a file in place of the encoder, whose time is reported apart): seconds and RSS.

Results are kept in ``--results`` (one entry per design and size, so the designs can be run apart);
the ``milvus_items`` section of docs/BENCHMARKS.md is written from all of them, unless ``--no-write``.

    flock /tmp/tonearm-heavy.lock python bench/milvus_items.py                          # both, the issue's sizes
    flock /tmp/tonearm-heavy.lock python bench/milvus_items.py --designs overlay        # one design
    python bench/milvus_items.py --milvus-sizes 10000 --overlay-sizes 10000 --no-write  # smoke, ~1 min
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench.benchlib import cpu_model, publish_section  # noqa: E402

START, END = "<!-- bench:milvus_items:start -->", "<!-- bench:milvus_items:end -->"
RESULTS = ROOT / "bench" / "results" / "milvus_items.json"
LICENSES = ("cc0", "cc-by", "cc-by-nc", "proprietary")
TAGS = ("rain", "wind", "night", "city", "birds", "sea", "crowd", "engine")
SELECTIVITY = {"none": None, "50 %": 5000, "1 %": 100, "0.01 %": 1}
"""Filter name → ``bucket`` bound (``{"bucket": {"lt": bound}}``; None: no filter)."""
K = 10
CHUNK = 10_000
"""Rows per generated chunk of items (each from its own seed: item ``i`` is the same at every size)."""
SEED = 47
TARGET_P50_MS = 100.0
TARGET_STARTUP_S = 60.0


# ---------------------------------------------------------------------- the items and queries


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def item_id(i: int) -> str:
    return f"item-{i:08d}"


def row_of(item: str) -> int:
    return int(item.rsplit("-", 1)[1])


class Items:
    """The bench's items: vectors and buckets made per chunk on demand (nothing holds all of them)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._cached: tuple[int, np.ndarray] | None = None

    def _chunk(self, c: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != c:
            self._cached = (c, _unit(np.random.default_rng([SEED, c, 0]), CHUNK, self.dim))
        return self._cached[1]

    def vectors(self, start: int, stop: int) -> np.ndarray:
        parts = [self._chunk(c)[max(start - c * CHUNK, 0): min(stop - c * CHUNK, CHUNK)]
                 for c in range(start // CHUNK, (stop - 1) // CHUNK + 1)] if stop > start else []
        return np.concatenate(parts) if parts else np.zeros((0, self.dim), np.float32)

    @staticmethod
    def buckets(n: int) -> np.ndarray:
        chunks = [np.random.default_rng([SEED, c, 1]).integers(0, 10_000, size=CHUNK) for c in range(-(-n // CHUNK))]
        return np.concatenate(chunks)[:n] if chunks else np.zeros(0, np.int64)

    @staticmethod
    def metadata(i: int, bucket: int) -> dict[str, Any]:
        return {"license": LICENSES[i % 4], "duration": float(1 + (i * 7919) % 300) / 10,
                "tags": sorted({TAGS[(i * p) % len(TAGS)] for p in (1, 3, 5)[: 1 + i % 3]}), "bucket": int(bucket)}

    @staticmethod
    def audio(i: int) -> bytes:
        """A distinct 32-byte placeholder per item (stored audio is content-addressed: equal bytes would share a vector)."""
        return f"tonearm-bench-item-{i:012d}".encode()


def queries(count: int, dim: int) -> np.ndarray:
    return _unit(np.random.default_rng([SEED, 1]), count, dim)


def exact_top_k(items: Items, n: int, qs: np.ndarray, buckets: np.ndarray) -> dict[str, np.ndarray]:
    """Per filter, the rows of the exact top-``K`` of each query (numpy, over chunks of 100k rows)."""
    best = {name: (np.full((len(qs), 0), -np.inf, np.float32), np.zeros((len(qs), 0), np.int64)) for name in SELECTIVITY}
    for start in range(0, n, 100_000):
        stop = min(n, start + 100_000)
        scores = qs @ items.vectors(start, stop).T  # (queries, rows)
        for name, below in SELECTIVITY.items():
            masked = scores if below is None else np.where(buckets[start:stop] < below, scores, -np.inf)
            take = min(K, masked.shape[1])
            top = np.argpartition(-masked, take - 1, axis=1)[:, :take]
            cand_scores = np.concatenate([best[name][0], np.take_along_axis(masked, top, axis=1)], axis=1)
            cand_rows = np.concatenate([best[name][1], top + start], axis=1)
            order = np.argsort(-cand_scores, axis=1, kind="stable")[:, :K]
            best[name] = (np.take_along_axis(cand_scores, order, axis=1), np.take_along_axis(cand_rows, order, axis=1))
    return {name: np.where(np.isfinite(s), r, -1) for name, (s, r) in best.items()}


def timed_queries(search: Callable[[np.ndarray], list[int]], qs: np.ndarray, truth: np.ndarray,
                  args: argparse.Namespace) -> dict[str, Any]:
    """Queries one at a time until ``--queries`` are done or ``--cell-seconds`` passed (at least
    ``--min-queries``): p50/p99 ms and mean recall@10 against ``truth``."""
    search(qs[0])  # warm: first plans, lazily built columns
    times, recalls = [], []
    began = time.perf_counter()
    for q, expected in zip(qs, truth, strict=True):
        t0 = time.perf_counter()
        found = search(q)
        times.append(time.perf_counter() - t0)
        exact = {int(r) for r in expected if r >= 0}
        recalls.append(len(exact & set(found)) / len(exact) if exact else float(not found))
        if len(times) >= args.min_queries and time.perf_counter() - began > args.cell_seconds:
            break
    p50, p99 = np.percentile(np.array(times) * 1000, [50, 99])
    return {"queries": len(times), "p50_ms": float(p50), "p99_ms": float(p99), "recall": float(np.mean(recalls)),
            "load": os.getloadavg()[0]}


def rss_mib(pid: int | str = "self", key: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def tree_rss_mib(pid: int) -> float:
    """RSS of a process and its descendants (the Milvus server is one ``milvus run standalone``)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    tree, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0.0
    for member in tree:
        try:
            total += rss_mib(member)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


# ---------------------------------------------------------------------- Milvus


def milvus_run(n: int, args: argparse.Namespace, uri: str, items: Items, server_pid: int | None) -> dict[str, Any]:
    from index.engines.filters import parse_filter
    from index.engines.milvus_index import MilvusTarget
    from index.items.milvus_store import MilvusItemStore

    buckets = Items.buckets(n)
    qs = queries(args.queries, args.dim)
    truth = exact_top_k(items, n, qs, buckets)
    target = MilvusTarget(uri=uri, prefix=f"bench{n}", timeout_s=60.0, bulk_timeout_s=1200.0)
    store = MilvusItemStore(target, dim=args.dim, index_type=args.index).open()
    load_before = os.getloadavg()[0]
    put_s = 0.0
    for start in range(0, n, args.batch):
        stop = min(n, start + args.batch)
        chunk = items.vectors(start, stop)
        batch = [(item_id(i), chunk[i - start], Items.metadata(i, buckets[i])) for i in range(start, stop)]
        docs = [{"audio": f"{i:064x}.wav", "captions": {}} for i in range(start, stop)]  # what a record keeps beside
        t0 = time.perf_counter()
        store.put(batch, docs=docs)
        put_s += time.perf_counter() - t0
    load_ingest = os.getloadavg()[0]
    index_wait_s, indexed = _wait_indexed(store, n, args.index_wait_s)
    result: dict[str, Any] = {
        "design": "milvus", "items": n, "dim": args.dim, "index": args.index, "batch": args.batch,
        "ingest_per_s": n / put_s, "index_wait_s": index_wait_s, "indexed_rows": indexed,
        "load_before": load_before, "load_ingest": load_ingest, "cells": {}}
    t0 = time.perf_counter()
    for _ in range(10):
        store.fields()
    result["fields_ms"] = (time.perf_counter() - t0) * 100
    for name, below in SELECTIVITY.items():
        flt = None if below is None else parse_filter({"bucket": {"lt": below}})

        def search(q: np.ndarray, flt: Any = flt) -> list[int]:
            return [row_of(i) for i in store.search(q[None, :], K, flt)[1][0]]

        result["cells"][name] = {**timed_queries(search, qs, truth[name], args),
                                 "passing": int(len(buckets) if below is None else np.count_nonzero(buckets < below))}
        print("milvus", n, name, result["cells"][name], flush=True)
    result["server_rss_mib"] = tree_rss_mib(server_pid) if server_pid else None
    result["request_puts"] = _request_puts(store, items, n, args.request_puts)
    store.drop()
    return result


def _request_puts(store: Any, items: Items, n: int, count: int) -> dict[str, float]:
    """``count`` puts of ``ITEMS_BATCH_MAX`` new items each (flushed), as one ``POST /v1/items:batch``
    would write them, on top of the ``n`` items: ms per put and items/s."""
    from service.routes.items import ITEMS_BATCH_MAX

    times = []
    buckets = Items.buckets(n + count * ITEMS_BATCH_MAX)
    for b in range(count):
        start = n + b * ITEMS_BATCH_MAX
        chunk = items.vectors(start, start + ITEMS_BATCH_MAX)
        batch = [(item_id(i), chunk[i - start], Items.metadata(i, buckets[i])) for i in range(start, start + ITEMS_BATCH_MAX)]
        t0 = time.perf_counter()
        store.put(batch)
        times.append(time.perf_counter() - t0)
    if not times:
        return {}
    p50, p99 = np.percentile(np.array(times) * 1000, [50, 99])
    return {"puts": count, "batch": ITEMS_BATCH_MAX, "p50_ms": float(p50), "p99_ms": float(p99),
            "items_per_s": count * ITEMS_BATCH_MAX / sum(times)}


def _wait_indexed(store: Any, n: int, limit_s: float) -> tuple[float, int | None]:
    """Seconds until the collection's vector index covers ``n`` rows (or ``limit_s`` passed), and the
    rows it covered then (None: the server does not say)."""
    client = store.target.client()
    started = time.perf_counter()
    indexed = None
    while True:
        try:
            names = client.list_indexes(store.collection)
            info = client.describe_index(store.collection, names[0]) if names else {}
            indexed = int(info["indexed_rows"]) if "indexed_rows" in info else None
        except Exception as err:  # an engine that does not report progress: search what there is
            print("index progress unavailable:", err, flush=True)
            return time.perf_counter() - started, None
        if indexed is None or indexed >= n or time.perf_counter() - started > limit_s:
            return time.perf_counter() - started, indexed
        time.sleep(2)


def milvus_runs(sizes: Sequence[int], args: argparse.Namespace, items: Items) -> Iterator[dict[str, Any]]:
    if args.milvus_uri:
        for n in sizes:
            yield milvus_run(n, args, args.milvus_uri, items, None)
        return
    from tests.milvus_server import MilvusStandalone

    with tempfile.TemporaryDirectory(prefix="milvus-items-") as work:
        server = MilvusStandalone(Path(work) / "milvus")
        server.start()
        try:
            for n in sizes:
                yield milvus_run(n, args, server.uri, items, server.pid)
        finally:
            server.kill()


# ---------------------------------------------------------------------- the overlay


class PrecomputedVectors:
    """The ``embed_audio`` of :func:`index.items.overlay.build_overlay`: the vector of each record's item,
    from the bench's items or from a raw float32 file (the replay), in place of the encoder."""

    def __init__(self, dim: int, items: Items | None = None, path: Path | None = None) -> None:
        self.dim, self.items, self.path, self.seconds = dim, items, path, 0.0

    def __call__(self, records: Sequence[Any]) -> np.ndarray:
        started = time.perf_counter()
        rows = np.array([row_of(r.id) for r in records], dtype=np.int64)
        out = np.empty((len(rows), self.dim), np.float32)
        if len(rows) and (np.diff(rows) == 1).all():  # one read / one slice for a run of items in order
            self._read(int(rows[0]), out)
        else:
            for j, row in enumerate(rows):
                self._read(int(row), out[j: j + 1])
        self.seconds += time.perf_counter() - started
        return out

    def _read(self, start: int, out: np.ndarray) -> None:
        if self.items is not None:
            out[:] = self.items.vectors(start, start + len(out))
            return
        assert self.path is not None
        with open(self.path, "rb") as handle:  # read(), not a memory map: the page cache is not this process's RSS
            handle.seek(start * self.dim * 4)
            handle.readinto(memoryview(out).cast("B"))


def _no_text(texts: Sequence[str]) -> np.ndarray:
    raise AssertionError("the bench's items have no captions")


def overlay_search(overlay: Any, flt: Any) -> Callable[[np.ndarray], list[int]]:
    """One search of the added items as ``Searcher.clip_filter`` + ``search_clips`` do it per request."""
    from index.engines.filters import merged_fields

    def search(q: np.ndarray) -> list[int]:
        allowed = None
        if flt is not None:
            table = overlay.metadata_table()
            allowed = table.mask(flt, fields=merged_fields([table]))
        _, rows = overlay.search_items(q[None, :], K, allowed)
        return [int(r) for r in rows[0] if r >= 0]  # n_clips = 0: a row is the item's number

    return search


def overlay_runs(sizes: Sequence[int], args: argparse.Namespace, items: Items) -> Iterator[dict[str, Any]]:
    from index.engines.filters import parse_filter
    from index.items.log import ItemLog
    from index.items.overlay import ItemOverlay, build_overlay
    from service.routes.items import ITEMS_BATCH_MAX

    filters = {name: None if below is None else parse_filter({"bucket": {"lt": below}})
               for name, below in SELECTIVITY.items()}
    with tempfile.TemporaryDirectory(prefix="overlay-items-", dir=args.work_dir) as work:
        log = ItemLog(Path(work) / "items")
        vector_file = Path(work) / "vectors.f32"
        overlay = ItemOverlay.empty(0, 0, args.dim)
        done = 0
        buckets = Items.buckets(max(sizes))
        for n in sorted(sizes):
            load_before = os.getloadavg()[0]
            ingest_s = 0.0
            added = n - done
            with open(vector_file, "ab") as vectors_out:
                while done < n:
                    stop = min(n, done + ITEMS_BATCH_MAX)
                    chunk = items.vectors(done, stop)
                    vectors_out.write(chunk.tobytes())
                    embed = PrecomputedVectors(args.dim, items)
                    t0 = time.perf_counter()
                    for i in range(done, stop):
                        log.put(item_id(i), Items.audio(i), audio_format="wav", metadata=Items.metadata(i, buckets[i]))
                    overlay = build_overlay(overlay, log.history(), clip_ids={}, embed_audio=embed, embed_text=_no_text)
                    ingest_s += time.perf_counter() - t0 - embed.seconds
                    done = stop
            load_ingest = os.getloadavg()[0]
            log_bytes = log.path.stat().st_size
            qs = queries(args.queries, args.dim)
            truth = exact_top_k(items, n, qs, buckets[:n])
            result: dict[str, Any] = {
                "design": "overlay", "items": n, "dim": args.dim, "batch": ITEMS_BATCH_MAX, "added_in_stage": added,
                "ingest_per_s": added / ingest_s, "log_mib": log_bytes / 2**20, "load_before": load_before,
                "load_ingest": load_ingest, "writer_rss_mib": rss_mib(), "cells": {}}
            for name, flt in filters.items():
                result["cells"][name] = {**timed_queries(overlay_search(overlay, flt), qs, truth[name], args),
                                         "passing": int(n if flt is None else np.count_nonzero(buckets[:n] < SELECTIVITY[name]))}
                print("overlay", n, name, result["cells"][name], flush=True)
            root = log.root
            if n == max(sizes):  # the writer's copy goes before a second one is built (1 M: ~5 GiB each)
                log.close()
                del log, overlay
                gc.collect()
            result["startup"] = _replay_in_fresh_process(root, vector_file, args.dim)
            print("overlay", n, "startup", result["startup"], flush=True)
            yield result


def _replay_in_fresh_process(log_dir: Path, vector_file: Path, dim: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--replay", str(log_dir), str(vector_file), "--dim", str(dim)],
                         check=True, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def replay(log_dir: Path, vector_file: Path, dim: int) -> dict[str, float]:
    """A replica's start: open the log, replay it into an overlay (vectors from ``vector_file`` in place
    of the encoder), answer one filtered search (the first builds the metadata columns)."""
    from index.engines.filters import parse_filter
    from index.items.log import ItemLog
    from index.items.overlay import ItemOverlay, build_overlay

    base = rss_mib()
    embed = PrecomputedVectors(dim, path=vector_file)
    t0 = time.perf_counter()
    log = ItemLog(log_dir)
    history = log.history()
    t1 = time.perf_counter()
    overlay = build_overlay(ItemOverlay.empty(0, 0, dim), history, clip_ids={}, embed_audio=embed, embed_text=_no_text)
    t2 = time.perf_counter()
    overlay_search(overlay, parse_filter({"bucket": {"lt": 100}}))(np.ones(dim, np.float32) / np.sqrt(dim))
    t3 = time.perf_counter()
    assert overlay.live_size == history.length, (overlay.live_size, history.length)
    return {"read_log_s": t1 - t0, "overlay_s": t2 - t1 - embed.seconds, "vectors_s": embed.seconds,
            "first_search_s": t3 - t2, "rss_base_mib": base, "rss_mib": rss_mib(),
            "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


# ---------------------------------------------------------------------- the section


def _fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b·x`` (b: the cost per item)."""
    x, y = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    if len(x) < 2:
        return 0.0, float(y[0] / x[0]) if len(x) else 0.0
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def _reach(a: float, b: float, limit: float) -> str:
    """Items at which ``a + b·items`` reaches ``limit``."""
    if b <= 0:
        return "not reached (flat)"
    at = (limit - a) / b
    return "already at the smallest size" if at <= 0 else f"~{at:,.0f} items"


def section(results: dict[str, dict[str, Any]]) -> str:
    milvus = sorted((r for r in results.values() if r["design"] == "milvus"), key=lambda r: r["items"])
    overlay = sorted((r for r in results.values() if r["design"] == "overlay"), key=lambda r: r["items"])
    lines = [START, "### Added items: Milvus vs the overlay on FAISS (`bench/milvus_items.py`, issue 47 part 5)", ""]
    for r in milvus + overlay:
        lines.append(f"- {r['design']} at {r['items']:,}: `{r['command']}` on {r['machine']}, {r['date']}; load "
                     f"(1 min) {r['load_before']:.2f} before, {r['load_ingest']:.2f} after the ingest, "
                     f"{min(c['load'] for c in r['cells'].values()):.2f}–{max(c['load'] for c in r['cells'].values()):.2f} "
                     "during the queries")
    lines += [
        "",
        "Same items (random unit vectors, metadata `license`, `duration`, `tags`, `bucket`), same queries, k = 10, "
        "one query at a time; filter `{\"bucket\": {\"lt\": …}}` at each selectivity; recall@10 against exact numpy "
        "search over the same vectors and mask. A cell runs up to the stated number of queries (fewer where a time "
        "budget per cell ran out: its p99 is then close to its maximum).",
        "",
        "| design | items | ingest items/s | filter | passing | queries | p50 ms | p99 ms | recall@10 |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in milvus + overlay:
        name = f"Milvus {r['index']}" if r["design"] == "milvus" else "overlay (exact)"
        for sel in (s for s in SELECTIVITY if s in r["cells"]):  # the results file sorts its keys
            c = r["cells"][sel]
            lines.append(f"| {name} | {r['items']:,} | {r['ingest_per_s']:,.0f} | {sel} | {c['passing']:,} | "
                         f"{c['queries']} | {c['p50_ms']:.1f} | {c['p99_ms']:.1f} | {c['recall']:.3f} |")
    if milvus:
        lines += ["", "Milvus: ingest is `put` of batches, each flushed; index wait: from the last put until the "
                  "server's vector index covers every row (searches before that scan unindexed segments); the "
                  "filter's field kinds are read from the store on each filtered search (its default). Request-sized puts: "
                  "after the queries, puts of one `POST /v1/items:batch`'s most items, each flushed, on top of the "
                  "collection (what a write through the service would cost).", "",
                  "| items | dim | index | put batch | ingest items/s | index wait s | fields read ms | server RSS MiB "
                  "| request-sized puts | put p50 ms | put p99 ms | items/s |",
                  "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in milvus:
            rss = f"{r['server_rss_mib']:,.0f}" if r.get("server_rss_mib") else "–"
            small = r.get("request_puts") or {}
            puts = (f"{small['puts']} × {small['batch']} | {small['p50_ms']:.0f} | {small['p99_ms']:.0f} | "
                    f"{small['items_per_s']:,.0f}") if small else "– | – | – | –"
            lines.append(f"| {r['items']:,} | {r['dim']} | {r['index']} | {r['batch']:,} | {r['ingest_per_s']:,.0f} | "
                         f"{r['index_wait_s']:.0f} | {r['fields_ms']:.1f} | {rss} | {puts} |")
    if overlay:
        lines += ["", "Overlay: ingest is `ItemLog.put` per item (32-byte stored audio and the record, each fsync'd) "
                  f"in batches of {overlay[0]['batch']} (`POST /v1/items:batch`'s most), each batch then applied to the "
                  "writer's overlay (`build_overlay`; the embedding replaced by precomputed vectors). Startup: a fresh "
                  "process opens the log and replays it into an overlay, then answers one filtered search; the vectors "
                  "are read from a file in place of the encoder (that time is given apart: a replica re-embeds every "
                  "item's audio there). RSS: the items' part (after minus before the replay) and the process's peak.", "",
                  "| items | log MiB | ingest items/s | read log s | build overlay s | first search s | startup s (no encoder) "
                  "| vectors read s | replica RSS for items MiB | peak RSS MiB |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in overlay:
            s = r["startup"]
            total = s["read_log_s"] + s["overlay_s"] + s["first_search_s"]
            lines.append(f"| {r['items']:,} | {r['log_mib']:,.0f} | {r['ingest_per_s']:,.0f} | {s['read_log_s']:.2f} | "
                         f"{s['overlay_s']:.2f} | {s['first_search_s']:.2f} | {total:.1f} | {s['vectors_s']:.2f} | "
                         f"{s['rss_mib'] - s['rss_base_mib']:,.0f} | {s['rss_peak_mib']:,.0f} |")
    lines += ["", "Where each design stops (least-squares lines through the measured sizes; a limit past the largest "
              "size measured is an extrapolation):", ""]
    if overlay:
        startup = _fit([(r["items"], sum(r["startup"][k] for k in ("read_log_s", "overlay_s", "first_search_s")))
                        for r in overlay])
        memory = _fit([(r["items"], r["startup"]["rss_mib"] - r["startup"]["rss_base_mib"]) for r in overlay])
        lines.append(f"- overlay: every replica holds every item — {memory[1] * 2**20:,.0f} bytes of RSS per item "
                     f"({memory[1] * 1e6 / 1024:,.1f} GiB per million) and {startup[1] * 1e6:,.1f} s of start-up "
                     f"replay per million items before any embedding; a {TARGET_STARTUP_S:.0f}-s start-up is reached at "
                     f"{_reach(*startup, TARGET_STARTUP_S)}.")
        for sel in SELECTIVITY:
            fit = _fit([(r["items"], r["cells"][sel]["p50_ms"]) for r in overlay])
            lines.append(f"- overlay, filter {sel}: p50 {fit[1] * 1e6:,.0f} ms per million items; "
                         f"{TARGET_P50_MS:.0f} ms p50 at {_reach(*fit, TARGET_P50_MS)}.")
    if milvus:
        for sel in SELECTIVITY:
            points = [(r["items"], r["cells"][sel]["p50_ms"]) for r in milvus]
            if len(points) == 1:
                p50 = points[0][1]
                lines.append(f"- Milvus, filter {sel}: p50 {p50:,.0f} ms at {points[0][0]:,} items "
                             f"({'within' if p50 <= TARGET_P50_MS else 'over'} {TARGET_P50_MS:.0f} ms).")
            else:
                fit = _fit(points)
                lines.append(f"- Milvus, filter {sel}: p50 {fit[1] * 1e6:,.0f} ms per million items; "
                             f"{TARGET_P50_MS:.0f} ms p50 at {_reach(*fit, TARGET_P50_MS)}.")
    lines.append(END)
    return "\n".join(lines)


# ---------------------------------------------------------------------- main


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--designs", default="overlay,milvus", help="comma-separated: overlay, milvus")
    parser.add_argument("--milvus-sizes", default="1000000", help="comma-separated numbers of items (Milvus)")
    parser.add_argument("--overlay-sizes", default="10000,100000,1000000", help="sizes the overlay's log grows through")
    parser.add_argument("--milvus-uri", help="an existing server or a milvus-lite *.db (default: a fresh 2.3.5 server)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--index", default="HNSW", choices=("FLAT", "HNSW", "IVF_FLAT", "AUTOINDEX"))
    parser.add_argument("--index-wait-s", type=float, default=1800.0, help="longest wait for the Milvus index")
    parser.add_argument("--batch", type=int, default=5000, help="items per Milvus put")
    parser.add_argument("--request-puts", type=int, default=40,
                        help="Milvus puts of one items:batch request's size, timed after the queries")
    parser.add_argument("--queries", type=int, default=200, help="most queries per cell")
    parser.add_argument("--min-queries", type=int, default=30, help="fewest queries per cell")
    parser.add_argument("--cell-seconds", type=float, default=60.0, help="time budget per cell past --min-queries")
    parser.add_argument("--work-dir", help="where the overlay's log is written (default: the temporary directory)")
    parser.add_argument("--results", type=Path, help=f"results kept per design and size (default {RESULTS.relative_to(ROOT)}; "
                        "written after each size, also with --no-write when given)")
    parser.add_argument("--no-write", action="store_true", help="print only; keep docs/BENCHMARKS.md (and the default results)")
    parser.add_argument("--replay", nargs=2, metavar=("LOG_DIR", "VECTORS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replay:
        print(json.dumps(replay(Path(args.replay[0]), Path(args.replay[1]), args.dim)))
        return 0

    designs = {d.strip() for d in args.designs.split(",") if d.strip()}
    results_path = args.results or RESULTS
    keep_results = args.results is not None or not args.no_write
    results: dict[str, dict[str, Any]] = json.loads(results_path.read_text()) if results_path.exists() else {}
    items = Items(args.dim)
    stamp = {"command": " ".join(["flock /tmp/tonearm-heavy.lock python bench/milvus_items.py",
                                  *(argv if argv is not None else sys.argv[1:])]),
             "machine": f"{cpu_model()}, {os.cpu_count()} cores"}
    runs = []
    if "overlay" in designs:
        runs.append(overlay_runs(_sizes(args.overlay_sizes), args, items))
    if "milvus" in designs:
        runs.append(milvus_runs(_sizes(args.milvus_sizes), args, items))
    for run in runs:
        for result in run:
            result.update(stamp, date=f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
            results[f"{result['design']}:{result['items']}"] = result
            if keep_results:  # after each size: a later failure keeps what was measured
                results_path.parent.mkdir(parents=True, exist_ok=True)
                results_path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    publish_section(section(results), start=START, end=END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
