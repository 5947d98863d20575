"""Benchmark: where the demo's tail latency comes from, and what freezing the GC does to it.

Cold text at 16 closed-loop clients on the demo bundle (bench/service_load.py's server and
client), with the service's ``TONEARM_GC_FREEZE`` on (default) and off, interleaved ``--repeats``
times so that both see the same machine. Per row: p50/p99/max latency, req/s, how many requests
were slow *together* (the share of the p99 tail that fell in 50-ms windows where at least half
the clients were slow: a pause of the whole process rather than one slow request), and the
generation-2 collections the server's own ``tonearm_gc_pause_seconds`` histogram counted during
the row. The filtered workloads (``text-cold-filter``: ~10 % of the clips pass, ``-wide``: ~90 %)
run once per mode beside an unfiltered row (issue 40: within 1.5× of the unfiltered p99).

Writes its section of docs/BENCHMARKS.md (command, machine, date, load at start and end).

    OMP_NUM_THREADS=1 python bench/service_tail.py [--bundle DEMO_BUNDLE] [--seconds 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from service_load import FILTERED_KINDS, Connection, Server, _text_body

from benchlib import bundle_or_demo, cpu_model, write_section

START = "<!-- bench:service_tail:start -->"
END = "<!-- bench:service_tail:end -->"
CLIENTS = 16
WINDOW_S = 0.05


async def _client(url: str, kind: str, stop_at: float, rows: list[tuple[float, float]], wid: int) -> None:
    host, port = url.removeprefix("http://").split(":")
    connection = Connection(host, int(port))
    i = 0
    try:
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            status, payload = await connection.request("POST", "/v1/search/text", _text_body(kind, wid, i),
                                                       "application/json")
            if status != 200:
                raise RuntimeError(f"{kind}: HTTP {status}: {payload[:300]!r}")
            rows.append((started, (time.perf_counter() - started) * 1000))
            i += 1
    finally:
        connection.close()


async def _load(url: str, kind: str, seconds: float) -> list[tuple[float, float]]:
    rows: list[tuple[float, float]] = []
    stop_at = time.perf_counter() + seconds
    await asyncio.gather(*(_client(url, kind, stop_at, rows, w) for w in range(CLIENTS)))
    return rows


def gen2_pauses(url: str) -> tuple[float, float]:
    """(count, seconds) of generation-2 collections so far, from the server's /metrics."""
    count = total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('tonearm_gc_pause_seconds_count{generation="2"}'):
            count = float(line.split()[-1])
        elif line.startswith('tonearm_gc_pause_seconds_sum{generation="2"}'):
            total = float(line.split()[-1])
    return count, total


def measure(url: str, kind: str, seconds: float) -> dict[str, float | str]:
    before = gen2_pauses(url)
    rows = np.asarray(asyncio.run(_load(url, kind, seconds)))
    after = gen2_pauses(url)
    started, latency = rows[:, 0], rows[:, 1]
    p50, p99 = np.percentile(latency, [50, 99])
    slow = latency > p99
    windows = ((started[slow] - started.min()) / WINDOW_S).astype(int)
    per_window = np.bincount(windows) if len(windows) else np.zeros(1, dtype=int)
    together = per_window[windows] >= CLIENTS // 2 if len(windows) else np.zeros(0, dtype=bool)
    collections = after[0] - before[0]
    return {"kind": kind, "requests": len(rows), "rps": len(rows) / seconds, "p50": p50, "p99": p99,
            "max": float(latency.max()), "together": float(together.mean()) if len(together) else 0.0,
            "gen2": collections, "gen2_ms": 1000 * (after[1] - before[1]) / collections if collections else 0.0,
            "load": os.getloadavg()[0]}


def table(rows: list[dict]) -> str:
    head = ("| GC freeze | workload | requests | req/s | p50 ms | p99 ms | max ms | tail slow together | "
            "gen-2 collections | mean gen-2 pause ms | load after |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    return head + "".join(
        f"| {r['mode']} | {r['kind']} | {r['requests']} | {r['rps']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | "
        f"{r['max']:.1f} | {100 * r['together']:.0f} % | {r['gen2']:.0f} | {r['gen2_ms']:.1f} | {r['load']:.2f} |\n"
        for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", help="bundle directory (default: the demo bundle, built if needed)")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    bundle = bundle_or_demo(args.bundle)
    load_start = os.getloadavg()[0]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for mode, value in (("off", "false"), ("on", "true")):
                os.environ["TONEARM_GC_FREEZE"] = value
                with Server(bundle, threads=4, redis_url=None, log=Path(scratch) / f"{mode}-{repeat}.log") as server:
                    asyncio.run(_load(server.url, "text-cold", 2.0))  # warm-up: thread pools, first batches
                    kinds = ["text-cold", *FILTERED_KINDS, "text-cold"] if repeat == 0 else ["text-cold"]
                    for kind in kinds:
                        rows.append({"mode": mode, **measure(server.url, kind, args.seconds)})
                        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    if not args.no_write:
        command = "OMP_NUM_THREADS=1 python bench/service_tail.py " + " ".join(sys.argv[1:])
        body = (
            f"{START}\n## service_tail — the demo's tail at 16 cold-text clients, GC freeze off/on (bench/service_tail.py)\n\n"
            f"- command: `{command.strip()}`\n"
            f"- machine: {cpu_model()}, {os.cpu_count()} cores; date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; "
            f"1-min load average {load_start:.2f} at the start (the last column: right after each row, i.e. the "
            f"benchmark's own load: server and load generator share the two cores)\n"
            f"- one uvicorn worker, defaults; `tail slow together`: share of the requests above the p99 that fell in "
            f"50-ms windows where ≥ {CLIENTS // 2} of the {CLIENTS} clients were slow (a stall of the whole process); "
            f"gen-2 collections and their mean pause from the server's `tonearm_gc_pause_seconds`. Target (issue 40): "
            f"p99 ≤ 20 ms; filtered rows within 1.5× of the unfiltered p99.\n\n"
            f"{table(rows)}\n{END}\n"
        )
        write_section(body, start=START, end=END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
