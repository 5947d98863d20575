"""Benchmark: latency percentiles and throughput of the search service under concurrent load.

Starts `tonearm serve` as a subprocess (real uvicorn, one worker, the thread pool
of the settings) and drives it from this process with N concurrent closed-loop
clients (asyncio, a minimal keep-alive HTTP/1.1 client each):

* text search, cache **cold** (every query unique) and **warm** (a fixed set of
  queries, answered once before measuring), and audio search (5 s WAV uploads,
  never cached), at 1, 8, 16 and 32 concurrent clients;
* against a bundle (``--bundle``, default the demo bundle) and against the same
  bundle with its clip index grown to synthetic 100 k and 1 M clips (unit vectors
  scattered around the real clips, index chosen by size through ``index.engines.faiss_index``; ``--synthetic-clips``);
* with ``--milvus``, the bundle once more through the Milvus backend (Milvus Lite:
  published by ``tonearm bundle publish`` to a local file first);
* beside each tonearm server, the **reference peer** (bench/reference_server.py:
  FastAPI + the PyTorch encoders in eager mode + FAISS, no cache, no batching — what
  a user would write by hand) on the same bundle and clients; the report gives
  tonearm's throughput and p99 as ratios to it (``--no-peer`` skips it).

Prints a table and writes (or replaces) the ``service_load`` section of
docs/BENCHMARKS.md with the command, machine, date and numbers. Client and
server share the machine's cores, so the numbers are a lower bound for a
dedicated server.

    OMP_NUM_THREADS=1 python bench/service_load.py --bundle BUNDLE_DIR
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import io
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from benchlib import bundle_or_demo, cpu_model, write_section

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "reference"
START = "<!-- bench:service_load:start -->"
END = "<!-- bench:service_load:end -->"
QUERIES = [
    "a dog barks twice then a siren passes", "un chien aboie puis une sirène passe",
    "ein Hund bellt zweimal", "un perro ladra y llueve", "een hond blaft in de regen",
    "un gos borda i plou", "犬が二回吠えてからサイレンが鳴る", "狗叫了两声然后警笛响起",
    "bells ring slowly far away", "rain falls while an engine hums", "a whistle and fast clapping",
    "birds chirp near a running tap", "quiet wind then loud drum hits", "une alarme bipe rapidement",
]


@dataclass
class Result:
    server: str
    target: str
    kind: str
    clients: int
    requests: int
    errors: int
    seconds: float
    latencies_ms: np.ndarray

    def row(self) -> dict[str, float | int | str]:
        p50, p95, p99 = np.percentile(self.latencies_ms, [50, 95, 99]) if len(self.latencies_ms) else (0, 0, 0)
        return {
            "server": self.server, "target": self.target, "kind": self.kind, "clients": self.clients, "requests": self.requests,
            "errors": self.errors, "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
            "rps": self.requests / self.seconds if self.seconds else 0.0,
        }


# ----------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`tonearm serve --bundle DIR` (or, ``reference=True``, bench/reference_server.py) in a
    subprocess, ready when /readyz answers 200."""

    def __init__(
        self, bundle: Path, *, threads: int, redis_url: str | None, log: Path, reference: bool = False,
        milvus_uri: str | None = None, checkpoint: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "TONEARM_SEARCH_THREADS": str(threads), "OMP_NUM_THREADS": "1"}
        if redis_url:
            env["TONEARM_REDIS_URL"] = redis_url
            env["TONEARM_KEY_PREFIX"] = f"bench{self.port}"
        if milvus_uri:
            env.update(TONEARM_INDEX_BACKEND="milvus", TONEARM_MILVUS_URI=milvus_uri)
        if reference:
            cmd = [sys.executable, str(ROOT / "bench" / "reference_server.py"), "--bundle", str(bundle),
                   "--port", str(self.port)] + (["--checkpoint", str(checkpoint)] if checkpoint else [])
        else:
            cmd = [sys.executable, "-m", "tonearm.cli", "serve", "--bundle", str(bundle), "--port", str(self.port)]
        with log.open("w") as sink:
            self.process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)

    def __enter__(self) -> Server:
        try:
            self._wait_ready(timeout=300)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tonearm serve exited:\n{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"tonearm serve not ready after {timeout} s:\n{self.log.read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


# ----------------------------------------------------------------------------- synthetic index


def synthetic_bundle(source: Path, parent: Path, clips: int, *, factory: str | None = None, seed: int = 0) -> Path:
    """``source`` with its clip index grown to ``clips`` vectors: the real clips first (so the
    caption index still points at valid rows), then unit vectors scattered around them (ids ``syn-000000``…)."""
    import faiss

    from index.bundle import format as fmt
    from index.engines.faiss_index import build_index, choose_factory, save_index

    manifest = fmt.read_manifest(source)
    real = faiss.read_index(str(source / manifest.audio_index.file))
    real_vectors = real.reconstruct_n(0, real.ntotal)
    rng = np.random.default_rng(seed)
    # Around the real clips (noise-to-signal 1): the neighbour structure of real embeddings,
    # which ANN indices rely on; uniform random vectors have none and make any IVF scan everything.
    count = clips - real.ntotal
    extra = real_vectors[rng.integers(0, real.ntotal, count)]
    extra = extra + rng.standard_normal((count, manifest.embed_dim)).astype(np.float32) / np.sqrt(manifest.embed_dim)
    extra /= np.linalg.norm(extra, axis=1, keepdims=True)
    vectors = np.concatenate([real_vectors, extra])
    factory = factory or choose_factory(clips, manifest.embed_dim)
    built = build_index(vectors, factory)
    bundle_id = f"{manifest.bundle_id}-syn{clips // 1000}k"
    ids_file = manifest.audio_index.ids_file
    with fmt.staged_bundle(parent, bundle_id) as staging:
        for rel in manifest.files:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            if rel not in (manifest.audio_index.file, ids_file):
                shutil.copyfile(source / rel, staging / rel)
        save_index(built.index, staging / manifest.audio_index.file)
        with (staging / ids_file).open("w", encoding="utf-8") as out:
            out.write((source / ids_file).read_text(encoding="utf-8"))
            for i in range(clips - real.ntotal):
                out.write(json.dumps({"id": f"syn-{i:06d}", "uri": None, "captions": {}}) + "\n")
        audio_index = manifest.audio_index.model_copy(
            update={"ntotal": clips, "factory": factory, "search_params": built.search_params,
                    "ann_recall_at_10": built.ann_recall_at_10}
        )
        return fmt.publish(staging, manifest.model_copy(update={"bundle_id": bundle_id, "audio_index": audio_index}))


# ----------------------------------------------------------------------------- load


def wav_clip(seconds: float = 5.0, rate: int = 16_000, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.2 * np.sin(2 * np.pi * 440 * t) * (1 + np.sin(2 * np.pi * 2 * t)) + 0.02 * rng.standard_normal(t.size)
    buffer = io.BytesIO()
    sf.write(buffer, wave.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


class Connection:
    """A minimal keep-alive HTTP/1.1 client (one request at a time per connection).

    httpx's per-request overhead (~1 ms of client CPU) dominated the first measurements
    on two shared cores; this client costs a few tens of microseconds per request."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = await self.reader.readexactly(length)
        return int(status_line.split()[1]), payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def text_query(kind: str, wid: int, i: int) -> str:
    """Query ``i`` of client ``wid``: the :data:`QUERIES` mix, made unique for ``text-cold`` (a suffix
    of client, count and clock). Every server a benchmark compares is sent these texts
    (bench/real_size.py sends them to Infinity too)."""
    query = QUERIES[(wid + i) % len(QUERIES)]
    if kind == "text-cold":
        query = f"{query} {wid}-{i}-{time.perf_counter_ns()}"
    return query


FILTERED_KINDS = {
    "text-cold-filter": {"split": "test"},  # the demo's test split: ~10 % of its clips
    "text-cold-filter-wide": {"not": {"split": "test"}},  # ~90 %
}
"""Cold text searches with a ``filter`` (issue 40: within 1.5× of the unfiltered p99)."""


def _text_body(kind: str, wid: int, i: int) -> bytes:
    body: dict[str, object] = {"query": text_query("text-cold" if kind in FILTERED_KINDS else kind, wid, i), "k": 10}
    if kind in FILTERED_KINDS:
        body["filter"] = FILTERED_KINDS[kind]
    return json.dumps(body).encode()


async def _worker(url: str, kind: str, stop_at: float, out: list, errors: list, wid: int, clip: bytes | None = None) -> None:
    host, port = url.removeprefix("http://").split(":")
    connection = Connection(host, int(port))
    audio = (clip or wav_clip()) if kind == "audio" else b""
    i = 0
    try:
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            try:
                if kind == "audio":
                    status, _ = await connection.request("POST", "/v1/search/audio?k=10", audio, "audio/wav")
                else:
                    body = _text_body(kind, wid, i)
                    status, _ = await connection.request("POST", "/v1/search/text", body, "application/json")
                ok = status == 200
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                ok = False
                connection.close()
                connection = Connection(host, int(port))
            (out if ok else errors).append((time.perf_counter() - started) * 1000)
            i += 1
    finally:
        connection.close()


async def measure(
    url: str, *, server: str, target: str, kind: str, clients: int, seconds: float, clip: bytes | None = None
) -> Result:
    """``clients`` closed-loop clients for ``seconds``; audio uploads ``clip`` (default: 5 s at 16 kHz)."""
    if kind == "text-warm":
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for q in QUERIES:
                await client.post("/v1/search/text", json={"query": q, "k": 10})
    out: list[float] = []
    errors: list[float] = []
    started = time.perf_counter()
    stop_at = started + seconds
    await asyncio.gather(*(_worker(url, kind, stop_at, out, errors, w, clip) for w in range(clients)))
    elapsed = time.perf_counter() - started
    return Result(server, target, kind, clients, len(out), len(errors), elapsed, np.asarray(out))


# ----------------------------------------------------------------------------- report




def table(rows: list[dict]) -> str:
    head = "| server | index | workload | clients | requests | errors | p50 ms | p95 ms | p99 ms | req/s |\n"
    head += "|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n"
    return head + "".join(
        f"| {r['server']} | {r['target']} | {r['kind']} | {r['clients']} | {r['requests']} | {r['errors']} | "
        f"{r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['p99_ms']:.1f} | {r['rps']:.0f} |\n"
        for r in rows
    )


def ratios(rows: list[dict]) -> str:
    """tonearm / reference throughput and p99 for every cell both servers ran."""
    peer = {(r["target"], r["kind"], r["clients"]): r for r in rows if r["server"] == REFERENCE}
    lines = []
    for r in rows:
        p = peer.get((r["target"], r["kind"], r["clients"]))
        if r["server"] == REFERENCE or p is None or not p["rps"]:
            continue
        lines.append(
            f"| {r['server']} | {r['target']} | {r['kind']} | {r['clients']} | {r['rps'] / p['rps']:.2f} "
            f"| {r['p99_ms'] / p['p99_ms']:.2f} |\n" if p["p99_ms"] else ""
        )
    if not lines:
        return ""
    head = "\nRatios to the reference peer (throughput: higher is better; p99: lower is better):\n\n"
    head += "| server | index | workload | clients | req/s ÷ peer | p99 ÷ peer |\n|---|---|---|---:|---:|---:|\n"
    return head + "".join(lines)


def section(rows: list[dict], *, command: str, notes: str) -> str:
    return (
        f"{START}\n## service_load — search latency and throughput (bench/service_load.py)\n\n"
        f"- command: `{command}`\n"
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}\n"
        f"- date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}; 1-min load average at the end "
        f"{os.getloadavg()[0]:.1f} (other jobs share the machine)\n"
        f"- setup: one uvicorn worker, micro-batched encoders (text and audio queues), in-process cache; "
        f"`{REFERENCE}` = bench/reference_server.py (FastAPI + PyTorch eager encoders + FAISS, no cache, "
        f"no batching) on the same bundle; the load generator runs on the same cores. Targets (two cores): "
        f"100k cold text at 16 clients ≥ 740 req/s with p99 ≤ 40 ms; demo cold text at 16 clients p99 ≤ 20 ms "
        f"and ≥ 1,000 req/s; demo audio at 8 clients ≥ 282 req/s; ≥ 3× the peer on every text workload "
        f"at 16 clients.\n\n"
        f"{table(rows)}{ratios(rows)}\n{notes}\n{END}\n"
    )




def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", help="bundle directory (default: the demo bundle, built if needed)")
    parser.add_argument("--clients", default="1,8,16,32")
    parser.add_argument("--seconds", type=float, default=5.0, help="measurement time per cell")
    parser.add_argument("--threads", type=int, default=4, help="TONEARM_SEARCH_THREADS of the server")
    parser.add_argument("--synthetic-clips", default="100000,1000000",
                        help="comma-separated sizes of synthetic clip indices; 0 skips them")
    parser.add_argument("--synthetic-factory", help="FAISS factory of the synthetic clip index (default: by size)")
    parser.add_argument("--redis-url", help="measure with a Redis cache instead of the in-process one")
    parser.add_argument("--milvus", action="store_true", help="also serve the bundle through Milvus Lite")
    parser.add_argument("--no-peer", action="store_true", help="skip the reference server")
    parser.add_argument("--checkpoint", help="PyTorch checkpoint of the peer (default: the bundle's source checkpoint)")
    parser.add_argument("--kinds", default="text-cold,text-warm,audio",
                        help="comma-separated: text-cold, text-warm, audio, " + ", ".join(FILTERED_KINDS))
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/BENCHMARKS.md")
    args = parser.parse_args()

    bundle = bundle_or_demo(args.bundle)
    clients = [int(c) for c in args.clients.split(",")]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        targets: list[tuple[str, Path, str | None]] = [("bundle", bundle, None)]
        for size in [int(n) for n in args.synthetic_clips.split(",") if int(n)]:
            synthetic = synthetic_bundle(bundle, Path(scratch), size, factory=args.synthetic_factory)
            factory = json.loads((synthetic / "manifest.json").read_text())["audio_index"]["factory"]
            targets.append((f"synthetic {size // 1000}k ({factory})", synthetic, None))
        if args.milvus:
            uri = str(Path(scratch) / "milvus.db")
            subprocess.run([sys.executable, "-m", "tonearm.cli", "bundle", "publish", str(bundle), "--milvus-uri", uri],
                           cwd=ROOT, check=True)
            targets.append(("bundle (Milvus Lite)", bundle, uri))
        for name, path, milvus_uri in targets:
            servers = [("tonearm", False)] + ([] if args.no_peer or milvus_uri else [(REFERENCE, True)])
            for server_name, reference in servers:
                log = Path(scratch) / f"serve-{len(rows)}.log"
                with Server(path, threads=args.threads, redis_url=args.redis_url, log=log, reference=reference,
                            milvus_uri=milvus_uri, checkpoint=args.checkpoint) as server:
                    for kind in args.kinds.split(","):
                        if reference and kind in FILTERED_KINDS:
                            continue  # the reference peer has no filters
                        for c in clients:
                            result = asyncio.run(measure(server.url, server=server_name, target=name, kind=kind,
                                                         clients=c, seconds=args.seconds))
                            rows.append(result.row())
                            print(table(rows[-1:]).splitlines()[-1], f"load {os.getloadavg()[0]:.1f}", flush=True)
    print(table(rows) + ratios(rows))
    manifest = json.loads((bundle / "manifest.json").read_text())
    notes = (
        f"Bundle `{manifest['bundle_id']}`: {manifest['audio_index']['ntotal']} clips "
        f"({manifest['audio_index']['factory']}), {manifest['text_index']['ntotal']} captions, "
        f"embed_dim {manifest['embed_dim']}, clip {manifest['clip_seconds']} s."
    )
    if not args.no_write:
        command = "OMP_NUM_THREADS=1 python bench/service_load.py " + " ".join(sys.argv[1:])
        write_section(section(rows, command=command.strip(), notes=notes), start=START, end=END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
