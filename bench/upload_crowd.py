"""Benchmark: a crowd of legitimate uploads against one replica (issue 55, part 1) — peak resident
memory, answers by status and latency at N concurrent uploads.

160 concurrent 54-s 48-kHz stereo WAVs (10.4 MB each, inside every documented limit) posted to the
public ``POST /v1/search/similar`` took a replica from 348 to 2,206 MiB, past the shipped Deployment's
2 GiB. Every audio route now reads its body within the process's upload memory budget
(``TONEARM_DECODE_MEMORY_BYTES``, service/memory_budget.py): a request that finds no room within
``TONEARM_UPLOAD_WAIT_S`` is refused 503 ``overloaded`` with ``Retry-After``. This measures it:

* **Server**: a fresh `tonearm serve` (real uvicorn, one worker) per crowd size, on ``--bundle`` (default
  the demo bundle, built if needed), or with ``--fake`` the tests' keyword bundle (an FFT for an
  encoder: a smoke run in seconds, no build); the budget and waits as given (defaults: the settings').
* **Crowd**: ``--crowd`` sizes (default 10, 40, 160): that many clients, one connection each, released
  together by a barrier, each posting the same ``--seconds`` s of ``--channels``-channel 16-bit WAV at
  ``--rate`` Hz (default 54 s × 48 kHz × 2: 10.4 MB, the issue's upload) once, no retry.
* **Memory**: the server's resident set after one warm-up upload (``VmRSS``, its peak ``VmHWM`` reset
  there through ``/proc/PID/clear_refs``), then its peak over the crowd (``VmHWM``, and ``VmRSS`` sampled
  every 20 ms); beside it what docs/service.md's formula allows the uploads
  (:func:`service.memory_budget.upload_memory_bytes` at N waiting connections) and the rest of the peak:
  the encoder calls running at once and the allocator, which must not grow with N.
* **Answers**: counts by status, p50 / p99 / max latency of the 200s and of the 503s, whether every 503
  carried ``Retry-After``.

Client and server share the machine's cores. Prints a table and, unless ``--no-write``, writes (or
replaces) the ``upload_crowd`` section of docs/BENCHMARKS.md.

    flock /tmp/tonearm-heavy.lock python bench/upload_crowd.py                 # demo bundle, 10/40/160
    python bench/upload_crowd.py --fake --crowd 10,40 --no-write               # smoke, ~1 min
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
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
from service.memory_budget import upload_memory_bytes  # noqa: E402
from service.settings import Settings  # noqa: E402

START, END = "<!-- bench:upload_crowd:start -->", "<!-- bench:upload_crowd:end -->"
MIB = 1 << 20

FAKE_SERVER = """
    import pathlib, sys
    from service.app import create_app
    from service.settings import Settings
    from tests.service.conftest import UvicornServer, fake_opener
    bundles = pathlib.Path(sys.argv[1])
    (bundles / "fake-a").mkdir()
    (bundles / "fake-a" / "manifest.json").write_text("{}")
    settings = Settings(bundles_dir=bundles, bundle="fake-a", environment="development")  # TONEARM_* from the env
    with UvicornServer(create_app(settings, opener=fake_opener)) as server:
        server.wait_ready()
        print(server.url, flush=True)
        sys.stdin.read()
"""


class FakeServer:
    """The tests' keyword bundle under real uvicorn in a child process (``--fake``)."""

    def __init__(self, work: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(FAKE_SERVER), str(work)], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> FakeServer:
        self.url = self.process.stdout.readline().strip()  # type: ignore[union-attr]
        if not self.url.startswith("http://"):
            self.__exit__()
            raise RuntimeError("the fake-bundle server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stdin.close()  # type: ignore[union-attr]
        self.process.wait(30)


def status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def upload(seconds: float, rate: int, channels: int) -> bytes:
    """A legitimate upload: tones and noise, 16-bit WAV."""
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * rate)) / rate
    mono = 0.2 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)
    wave = np.stack([mono * (1 - 0.1 * c) for c in range(channels)], axis=1).astype(np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, wave, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@dataclass
class Crowd:
    n: int
    statuses: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    retry_after: list[str | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    rss_before: int = 0
    peak: int = 0
    sampled_peak: int = 0
    wall: float = 0.0


def drive(url: str, pid: int, body: bytes, n: int) -> Crowd:
    """``n`` clients post ``body`` at once; the server's memory before and at its peak."""
    crowd = Crowd(n)
    with httpx.Client(base_url=url, timeout=300) as client:
        warm = client.post("/v1/search/similar", content=body)
        if warm.status_code != 200:
            raise RuntimeError(f"warm-up upload: {warm.status_code} {warm.text[:300]}")
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM from now on
        crowd.rss_before = status(pid, "VmRSS")
    except OSError:  # a kernel without it: the peak so far
        crowd.rss_before = status(pid, "VmHWM")
    lock, barrier, done = threading.Lock(), threading.Barrier(n), threading.Event()

    def sample() -> None:
        while not done.is_set():
            crowd.sampled_peak = max(crowd.sampled_peak, status(pid, "VmRSS"))
            time.sleep(0.02)

    def post() -> None:
        try:
            with httpx.Client(base_url=url, timeout=300) as client:  # one connection per client
                barrier.wait(60)
                began = time.perf_counter()
                r = client.post("/v1/search/similar", content=body)
                with lock:
                    crowd.statuses.append(r.status_code)
                    crowd.seconds.append(time.perf_counter() - began)
                    crowd.retry_after.append(r.headers.get("retry-after"))
        except Exception as err:  # noqa: BLE001 — a connection error is an answer to count too
            with lock:
                crowd.errors.append(f"{type(err).__name__}: {err}"[:200])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=post) for _ in range(n)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    crowd.wall = time.perf_counter() - began
    done.set()
    sampler.join(5)
    crowd.peak = status(pid, "VmHWM")
    return crowd


def ms(values: list[float]) -> str:
    if not values:
        return "– | – | –"
    p50, p99, top = np.percentile(np.asarray(values) * 1000, [50, 99, 100])
    return f"{p50:.0f} | {p99:.0f} | {top:.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", help="bundle directory (default: the demo bundle, built if needed)")
    parser.add_argument("--fake", action="store_true", help="serve the tests' keyword bundle (smoke run, no build)")
    parser.add_argument("--crowd", default="10,40,160", help="comma-separated numbers of concurrent uploads")
    parser.add_argument("--seconds", type=float, default=54.0, help="upload length (s)")
    parser.add_argument("--rate", type=int, default=48_000, help="upload sample rate (Hz)")
    parser.add_argument("--channels", type=int, default=2, help="upload channels")
    parser.add_argument("--budget", type=int, default=None,
                        help="TONEARM_DECODE_MEMORY_BYTES of the server (default: the setting's default)")
    parser.add_argument("--wait", type=float, default=None, help="TONEARM_UPLOAD_WAIT_S (default: the setting's)")
    parser.add_argument("--threads", type=int, default=4, help="TONEARM_SEARCH_THREADS of the server")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/BENCHMARKS.md")
    args = parser.parse_args()

    sizes = [int(n) for n in args.crowd.split(",") if n]
    env = {"TONEARM_SEARCH_THREADS": str(args.threads)}
    if args.budget is not None:
        env["TONEARM_DECODE_MEMORY_BYTES"] = str(args.budget)
    if args.wait is not None:
        env["TONEARM_UPLOAD_WAIT_S"] = str(args.wait)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the servers take this process's environment
    settings = Settings(environment="development")  # the servers' budget and limits, as they read them
    bundle = None if args.fake else bundle_or_demo(args.bundle)
    body = upload(args.seconds, args.rate, args.channels)
    load_before = os.getloadavg()
    rows: list[Crowd] = []
    try:
        for n in sizes:
            with tempfile.TemporaryDirectory(prefix="upload-crowd-") as work:
                if bundle is None:
                    with FakeServer(Path(work)) as fake:
                        rows.append(drive(fake.url, fake.process.pid, body, n))
                else:
                    with Server(bundle, threads=args.threads, redis_url=None, log=Path(work) / "server.log") as server:
                        rows.append(drive(server.url, server.process.pid, body, n))
            r = rows[-1]
            print(f"N={n}: {r.statuses.count(200)} x 200, {r.statuses.count(503)} x 503, {len(r.errors)} errors; "
                  f"RSS {r.rss_before / MIB:.0f} -> peak {r.peak / MIB:.0f} MiB; load {os.getloadavg()[0]:.2f}",
                  flush=True)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    load_after = os.getloadavg()

    if bundle is None:
        served = "the tests' keyword bundle (`--fake`: an FFT for an encoder)"
    else:
        manifest = json.loads((bundle / "manifest.json").read_text())
        served = f"bundle `{manifest['bundle_id']}` ({manifest['audio_index']['ntotal']} clips)"
    lines = [
        START,
        "## upload_crowd — a crowd of legitimate uploads against one replica (bench/upload_crowd.py)",
        "",
        f"- command: `{' '.join(['python bench/upload_crowd.py', *sys.argv[1:]])}`",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores; date {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
        f"load average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1 min)",
        f"- server: a fresh `tonearm serve` per row on {served}; TONEARM_DECODE_MEMORY_BYTES "
        f"{settings.decode_memory_bytes} ({settings.decode_memory_bytes / MIB:.0f} MiB), TONEARM_UPLOAD_WAIT_S "
        f"{settings.upload_wait_s:g}, TONEARM_SEARCH_THREADS {args.threads}",
        f"- crowd: N clients, one connection each, released together, each posting one {args.seconds:g}-s "
        f"{args.rate}-Hz {args.channels}-channel 16-bit WAV ({len(body) / 1e6:.1f} MB) to `POST /v1/search/similar` "
        "once (no retry)",
        "- RSS: the server's resident set after a warm-up upload; peak: its `VmHWM` over the crowd (reset after the "
        "warm-up); uploads: the most the uploads may add by docs/service.md's formula "
        "(`service.memory_budget.upload_memory_bytes`: budget + one body's copy + multipart slack + N waiting "
        "connections × 0.25 MiB); rest: peak − RSS − uploads, what the encoder calls running at once (the pool's "
        "threads) and the allocator add — bounded by threads, not by N, and part of the formula's serving memory",
        "",
        "| N | 200 | 503 (all with Retry-After) | other / errors | 200 p50 / p99 / max ms | 503 p50 / p99 / max ms "
        "| wall s | RSS MiB | peak MiB (sampled) | peak − RSS MiB | uploads MiB | rest MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ok = [s for s, code in zip(r.seconds, r.statuses, strict=True) if code == 200]
        refused = [s for s, code in zip(r.seconds, r.statuses, strict=True) if code == 503]
        tagged = all(ra is not None for ra, code in zip(r.retry_after, r.statuses, strict=True) if code == 503)
        other = sum(code not in (200, 503) for code in r.statuses) + len(r.errors)
        uploads = upload_memory_bytes(settings, waiting=r.n)
        lines.append(
            f"| {r.n} | {r.statuses.count(200)} | {r.statuses.count(503)} ({'yes' if tagged else 'NO'}) | {other} "
            f"| {ms(ok).replace(' | ', ' / ')} | {ms(refused).replace(' | ', ' / ')} | {r.wall:.1f} "
            f"| {r.rss_before / MIB:.0f} | {r.peak / MIB:.0f} ({r.sampled_peak / MIB:.0f}) | {(r.peak - r.rss_before) / MIB:.0f} "
            f"| {uploads / MIB:.0f} | {(r.peak - r.rss_before - uploads) / MIB:.0f} |")
    errors = [e for r in rows for e in r.errors]
    if errors:
        lines += ["", f"Client errors ({len(errors)}; first 3): " + "; ".join(errors[:3])]
    lines.append(END)
    publish_section("\n".join(lines), start=START, end=END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
