"""Benchmark: ingest through the item routes (issue 40) — items/s through ``POST /v1/items:batch`` and
the time from a 201 to the item being found by a search, on this replica and on a second one.

* **Servers**: two `tonearm serve` processes over the same bundle (``--bundle``, default the demo
  bundle, built if needed) sharing one item log (``TONEARM_ITEMS_DIR`` in a fresh temporary
  directory): replica A takes every write, replica B only follows the log (its poll,
  ``TONEARM_ITEMS_POLL_S``, default 0.2 s), as two replicas on one bundles volume do.
* **Items**: distinct synthetic sounds of the bundle's clip length and sample rate (a few random
  tones with noise, 16-bit WAV), each with metadata (``license``, ``n``); every upload is embedded
  by the bundle's audio encoder on A, so the audio is what a real upload costs.
* **Throughput**: ``--items`` items posted one batch at a time (one client, ``--batch`` items per
  ``POST /v1/items:batch``; also batches of 1 through ``POST /v1/items``): items/s = items / wall time
  of the 201s. The catalogue grows while it is measured, so the table gives the first and the second
  half of each run apart (equal when a write's cost does not grow with the catalogue).
* **201 → searchable**: ``--latency-items`` single ``POST /v1/items``, one at a time; after each 201
  the client polls ``POST /v1/search/text`` with ``filter: {"id": <new id>}`` (k = 1) until the new
  id is the hit — on A (where the 201 came from: searchable at the 201 by design, so its first poll
  should already see it) and on B (the follower) — and records the time from the 201 to the first
  answer that holds it. Time to 201 (upload + decode + fsync'd record + embedding + overlay) is
  reported beside it. Target (issue 40): p99 ≤ 1 s from 201 to searchable.
* **Per-write cost at N added items**: one write through the real code (``ItemLog.put``: stored
  audio and record fsync'd, then :func:`index.items.overlay.build_overlay` from the previous overlay) with
  ``--write-sizes`` items already in the log, measured in this process on synthetic records
  (vectors from a stand-in embedder: the encoder's time is the same at every size and is in the
  table above); the overlay part alone beside it. A write appends to the overlay, so both should be
  flat in N. Also the time of one ``ItemLog.compact`` of a log of N live items and N replaced ones
  (what the follower does past ``TONEARM_ITEMS_COMPACT_MIN``).

Client and servers share the machine's cores. Prints a table and writes (or replaces) the
``items_ingest`` section of docs/BENCHMARKS.md.

    flock /tmp/tonearm-heavy.lock python bench/items_ingest.py                  # demo bundle, writes its section
    python bench/items_ingest.py --items 64 --latency-items 10 --no-write       # smoke, ~1 min once built
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench.benchlib import bundle_or_demo, cpu_model, publish_section  # noqa: E402
from bench.service_load import Server  # noqa: E402

START, END = "<!-- bench:items_ingest:start -->", "<!-- bench:items_ingest:end -->"
TOKEN = "items-ingest-bench-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
POLL_TIMEOUT_S = 10.0
PROBE_QUERY = "a sound"


def sound(seed: int, seconds: float, rate: int) -> bytes:
    """A distinct sound per seed: three random tones, an envelope and noise, as 16-bit WAV."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    wave = sum(rng.uniform(0.05, 0.2) * np.sin(2 * np.pi * rng.uniform(80, rate / 2.5) * t) for _ in range(3))
    wave = wave * (0.6 + 0.4 * np.sin(2 * np.pi * rng.uniform(0.2, 3) * t)) + 0.02 * rng.standard_normal(t.size)
    buffer = io.BytesIO()
    sf.write(buffer, np.clip(wave, -1, 1).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


class Items:
    """Item ids, metadata and audio, made on demand (seed = running number)."""

    def __init__(self, seconds: float, rate: int) -> None:
        self.seconds, self.rate, self.count = seconds, rate, 0

    def next(self, prefix: str) -> tuple[str, dict, bytes]:
        n = self.count
        self.count += 1
        return f"{prefix}-{n:06d}", {"license": ("cc0", "by")[n % 2], "n": n}, sound(n, self.seconds, self.rate)


def post_batch(client: httpx.Client, batch: list[tuple[str, dict, bytes]]) -> None:
    if len(batch) == 1:
        item_id, meta, audio = batch[0]
        r = client.post("/v1/items", headers=ADMIN, data={"id": item_id, "metadata": json.dumps(meta)},
                        files={"file": ("a.wav", audio, "audio/wav")})
    else:
        r = client.post("/v1/items:batch", headers=ADMIN,
                        files=[("file", (f"{i}.wav", audio, "audio/wav")) for i, (_, _, audio) in enumerate(batch)],
                        data={"items": json.dumps([{"id": item_id, "metadata": meta} for item_id, meta, _ in batch])})
    if r.status_code != 201:
        raise RuntimeError(f"{r.status_code}: {r.text[:500]}")


def throughput(client: httpx.Client, items: Items, *, n: int, batch: int, prefix: str) -> dict:
    """``n`` items in batches of ``batch``; items/s overall and per half (the catalogue grows)."""
    # the sounds are made before the clock starts: only the requests are timed
    payload = [items.next(prefix) for _ in range(n)]
    stamps = []
    started = time.perf_counter()
    for start in range(0, n, batch):
        post_batch(client, payload[start : start + batch])
        stamps.append((start + min(batch, n - start), time.perf_counter() - started))
    total = stamps[-1][1]
    half = next((done, t) for done, t in stamps if done >= n // 2)
    return {"batch": batch, "items": n, "seconds": total, "rate": n / total,
            "first_half": half[0] / half[1], "second_half": (n - half[0]) / max(total - half[1], 1e-9)}


def found(client: httpx.Client, item_id: str) -> bool:
    r = client.post("/v1/search/text", json={"query": PROBE_QUERY, "k": 1, "filter": {"id": item_id}})
    return r.status_code == 200 and any(hit["id"] == item_id for hit in r.json()["hits"])


def until_found(client: httpx.Client, item_id: str, since: float) -> tuple[float, int]:
    """Seconds from ``since`` until a search on ``client`` holds ``item_id``, and the polls it took."""
    polls = 0
    while True:
        polls += 1
        if found(client, item_id):
            return time.perf_counter() - since, polls
        if time.perf_counter() - since > POLL_TIMEOUT_S:
            raise RuntimeError(f"{item_id} not searchable {POLL_TIMEOUT_S} s after its 201")
        time.sleep(0.002)


def latencies(a: httpx.Client, b: httpx.Client, items: Items, *, n: int) -> dict[str, np.ndarray]:
    """Per single POST /v1/items: time to the 201, then 201 → found on A and 201 → found on B."""
    out: dict[str, list[float]] = {"post": [], "a": [], "b": [], "a_polls": []}
    for _ in range(n):
        payload = items.next("lat")
        sent = time.perf_counter()
        post_batch(a, [payload])
        acked = time.perf_counter()
        on_a, polls = until_found(a, payload[0], acked)
        on_b, _ = until_found(b, payload[0], acked)
        out["post"].append(acked - sent)
        out["a"].append(on_a)
        out["b"].append(on_b)
        out["a_polls"].append(polls)
        time.sleep(0.05)  # the next item does not land in the same poll of B
    return {key: np.asarray(values) for key, values in out.items()}


def write_costs(n: int, dim: int, writes: int = 40) -> dict[str, float]:
    """Per-write milliseconds (median and p99) with ``n`` added items already in the log: ``ItemLog.put``
    then :func:`build_overlay` (``total``), the overlay part alone (``overlay``), and one compaction of
    ``n`` live + ``n`` replaced records (``compact``)."""
    from index.items.log import ItemLog, ItemRecord
    from index.items.overlay import ItemOverlay, build_overlay

    rng = np.random.default_rng(n)

    def embed(records: list) -> np.ndarray:
        vectors = rng.standard_normal((len(records), dim)).astype(np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    with tempfile.TemporaryDirectory(prefix="items-write-") as work:
        log = ItemLog(work)
        seed = log.put("seed", b"seed-audio", audio_format="wav")
        with open(log.path, "a", encoding="utf-8") as handle:  # n items written as the log writes them
            for i in range(n):
                meta = {"license": ("cc0", "by")[i % 2], "n": i, "duration": 5.0, "tags": ["a", f"t{i % 7}"]}
                handle.write(ItemRecord("put", f"item-{i:06d}", seed.at, seed.audio, meta).to_json() + "\n")
        overlay = build_overlay(ItemOverlay.empty(0, 0, dim), log.history(), clip_ids={}, embed_audio=embed,
                                embed_text=embed)
        total, part = [], []
        for w in range(writes):
            started = time.perf_counter()
            log.put(f"new-{w}", f"new-{w}".encode(), audio_format="wav", metadata={"license": "by", "n": -w})
            history = log.history()
            middle = time.perf_counter()
            overlay = build_overlay(overlay, history, clip_ids={}, embed_audio=embed, embed_text=embed)
            done = time.perf_counter()
            total.append(done - started)
            part.append(done - middle)
        with open(log.path, "a", encoding="utf-8") as handle:  # as many replaced records as live ones
            for i in range(n):
                handle.write(ItemRecord("put", f"item-{i:06d}", seed.at, seed.audio, {"n": i}).to_json() + "\n")
        log.follow()
        started = time.perf_counter()
        log.compact()
        compact_s = time.perf_counter() - started
    return {"total_p50": float(np.median(total)) * 1000, "total_p99": float(np.percentile(total, 99)) * 1000,
            "overlay_p50": float(np.median(part)) * 1000, "overlay_p99": float(np.percentile(part, 99)) * 1000,
            "compact": compact_s * 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", help="bundle directory (default: the demo bundle, built if needed)")
    parser.add_argument("--items", type=int, default=1000, help="items per throughput run")
    parser.add_argument("--batch", default="1,8,32", help="comma-separated items per request (1: POST /v1/items)")
    parser.add_argument("--latency-items", type=int, default=200, help="single posts timed 201 → searchable")
    parser.add_argument("--poll-s", type=float, default=0.2, help="TONEARM_ITEMS_POLL_S of both replicas")
    parser.add_argument("--threads", type=int, default=4, help="TONEARM_SEARCH_THREADS of the servers")
    parser.add_argument("--write-sizes", default="1000,5000,10000,30000",
                        help="added items at which one write (put + overlay) is timed (in this process)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/BENCHMARKS.md")
    args = parser.parse_args()

    bundle = bundle_or_demo(args.bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    rate, seconds = int(manifest["sample_rate"]), float(manifest["clip_seconds"])
    batches = [int(b) for b in args.batch.split(",")]
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="items-ingest-") as work:
        env = {"TONEARM_ITEMS_DIR": str(Path(work) / "items"), "TONEARM_ADMIN_TOKEN": TOKEN,
               "TONEARM_ITEMS_POLL_S": str(args.poll_s)}
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)  # Server passes this process's environment on
        try:
            with Server(bundle, threads=args.threads, redis_url=None, log=Path(work) / "a.log") as server_a, \
                    Server(bundle, threads=args.threads, redis_url=None, log=Path(work) / "b.log") as server_b, \
                    httpx.Client(base_url=server_a.url, timeout=120) as a, \
                    httpx.Client(base_url=server_b.url, timeout=120) as b:
                items = Items(seconds, rate)
                post_batch(a, [items.next("warm")])  # first-call costs out of the measurement
                until_found(b, "warm-000000", time.perf_counter())
                for batch in batches:
                    rows.append(throughput(a, items, n=args.items, batch=batch, prefix=f"b{batch}"))
                    print(rows[-1], f"load {os.getloadavg()[0]:.2f}", flush=True)
                before_latency = items.count
                lat = latencies(a, b, items, n=args.latency_items)
                catalogue = items.count
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    load_after = os.getloadavg()
    costs = {n: write_costs(n, int(manifest["embed_dim"])) for n in (int(x) for x in args.write_sizes.split(",") if x)}

    def ms(values: np.ndarray) -> str:
        p50, p99, top = np.percentile(values, [50, 99, 100]) * 1000
        return f"{p50:.0f} | {p99:.0f} | {top:.0f}"

    audio = manifest["audio_index"]
    lines = [
        START,
        "## items_ingest — items/s through `POST /v1/items:batch` and 201 → searchable (bench/items_ingest.py)",
        "",
        f"- command: `{' '.join(['flock /tmp/tonearm-heavy.lock python bench/items_ingest.py', *sys.argv[1:]])}`",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores; date {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
        f"load average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1 min)",
        f"- bundle `{manifest['bundle_id']}`: {audio['ntotal']} clips ({audio['factory']}), embed_dim "
        f"{manifest['embed_dim']}; items: synthetic {seconds:g}-s WAV at {rate} Hz "
        f"({len(sound(0, seconds, rate)) // 1024} KiB each) with two metadata fields; {catalogue} items added "
        f"in all (the catalogue grows through the runs, in the order of the table)",
        "- two `tonearm serve` replicas on one item log (TONEARM_ITEMS_DIR); A takes the writes, B follows "
        f"the log every {args.poll_s:g} s; one client, one request at a time; client and servers share the cores",
        "",
        "| request | items | s | items/s | first half items/s | second half items/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        route = "`POST /v1/items`" if r["batch"] == 1 else f"`POST /v1/items:batch` × {r['batch']}"
        lines.append(f"| {route} | {r['items']} | {r['seconds']:.1f} | {r['rate']:.1f} | "
                     f"{r['first_half']:.1f} | {r['second_half']:.1f} |")
    lines += [
        "",
        f"{args.latency_items} single `POST /v1/items` (the log already holding {before_latency} added items), one at "
        "a time; then `search/text` with `filter: {\"id\": …}` polled until the new id is the hit:",
        "",
        "| interval | p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|",
        f"| request sent → 201 (decode, fsync'd record, embedding, overlay) | {ms(lat['post'])} |",
        f"| 201 → searchable on A (the replica that answered; first poll found it in "
        f"{int((lat['a_polls'] == 1).sum())}/{len(lat['a_polls'])}) | {ms(lat['a'])} |",
        f"| 201 → searchable on B (follower, poll {args.poll_s:g} s) | {ms(lat['b'])} |",
        "",
        f"Target (issue 40): 201 → searchable p99 ≤ 1 s — {'met' if np.percentile(lat['b'], 99) <= 1 else 'NOT met'} "
        "on the follower; on the replica that answered the item is searchable at the 201 by construction "
        "(the overlay is updated before the answer), so its number is one search round trip.",
        "",
        "Each write appends to the overlay (`index.items.overlay.build_overlay`: the new row, its captions and its "
        "metadata; replaced rows are tombstones until a compaction), so its cost does not grow with the number "
        "of added items; the follower B embeds every item with its own encoder too (each replica embeds for "
        "itself), on the same two cores as A and the client — most of the load after the run is the run's own.",
        "",
        "One write through the real code with N added items already in the log (`ItemLog.put`, fsync'd, then "
        "`build_overlay`; synthetic records, a stand-in embedder: the encoder's time is the same at every N and "
        "is in the rows above), 40 writes each; and one `ItemLog.compact` of N live + N replaced records:",
        "",
        "| added items N | write p50 ms | write p99 ms | overlay part p50 ms | overlay part p99 ms | compaction ms |",
        "|---:|---:|---:|---:|---:|---:|",
        *(f"| {n:,} | {c['total_p50']:.2f} | {c['total_p99']:.2f} | {c['overlay_p50']:.3f} | "
          f"{c['overlay_p99']:.3f} | {c['compact']:.0f} |" for n, c in costs.items()),
        END,
    ]
    publish_section("\n".join(lines), start=START, end=END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
