"""Milvus outage under load: first-503 latency, hung requests, recovery time (docs/BENCHMARKS.md).

The real service (uvicorn, ``TONEARM_INDEX_BACKEND=milvus``) serves a bundle published to a real
Milvus standalone server (the ``milvus`` package's, as the tests use: tests/milvus_server.py).
``--clients`` threads send text searches (each query unique: no cache hit hides Milvus) with a
bounded client timeout while the server is SIGKILLed, left down, and started again on its data.

Measured: the first 503 ``index-unavailable`` after the kill and the latency of every 503 (target:
within the Milvus deadline ``TONEARM_MILVUS_TIMEOUT_S``), requests with no answer within the
client timeout (target 0), other 5xx (target 0), and recovery: from Milvus answering a search
again (a fresh client probing it) to the service's first 200 (target ≤ 5 s), and from the
restarted server's health check to that 200 (includes Milvus's own recovery: its session TTL).

    quiet-run python bench/milvus_outage.py --bundle BUNDLE_DIR    # ~1 min; writes its section

:func:`run_outage` is also the scenario of the fault test (tests/service/test_milvus_outage.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.benchlib import cpu_model, publish_section  # noqa: E402

START, END = "<!-- bench:milvus_outage:start -->", "<!-- bench:milvus_outage:end -->"
WORDS = ("dog", "bark", "rain", "roof", "bell", "siren", "bird", "wind", "car", "door", "water", "music")


@dataclass
class Request:
    sent: float
    done: float
    status: int | None  # None: no answer within the client timeout, or a transport error
    problem: str | None = None
    retry_after: str | None = None
    error: str | None = None
    detail: str | None = None  # the problem document's detail (what failed, for a failure's report)


@dataclass
class OutageRun:
    requests: list[Request] = field(default_factory=list)
    frozen: float = 0.0
    thawed: float = 0.0
    killed: float = 0.0
    restarted: float = 0.0
    server_up: float = 0.0
    milvus_answers: float = 0.0
    service_ok: float | None = None
    deadline_s: float = 0.0
    client_timeout_s: float = 0.0

    def after_recovery(self) -> list[Request]:
        return [r for r in self.requests if self.service_ok is not None and r.sent >= self.service_ok]

    def summary(self) -> dict[str, Any]:
        unavailable = [r for r in self.requests if r.status == 503 and r.problem == "index-unavailable"]
        seen = {id(r) for r in unavailable}
        after_kill = [r for r in unavailable if r.sent >= self.killed]
        latencies = sorted(r.done - r.sent for r in unavailable)
        frozen = sorted(r.done - r.sent for r in unavailable if self.frozen <= r.sent < self.thawed)
        return {
            "requests": len(self.requests),
            "ok": sum(r.status == 200 for r in self.requests),
            "index_unavailable": len(unavailable),
            "other_5xx": sum(r.status is not None and r.status >= 500 and id(r) not in seen for r in self.requests),
            "other_errors": sum(r.status not in (200, 503) and r.status is not None for r in self.requests),
            "hung": sum(r.status is None for r in self.requests),
            "without_retry_after": sum(r.retry_after is None for r in unavailable),
            "first_503_s": min((r.done for r in after_kill), default=float("nan")) - self.killed,
            "503_latency_p50_s": latencies[len(latencies) // 2] if latencies else float("nan"),
            "503_latency_max_s": latencies[-1] if latencies else float("nan"),
            "frozen_503": len(frozen),
            "frozen_503_max_s": frozen[-1] if frozen else float("nan"),
            "server_restart_s": self.server_up - self.restarted,
            "milvus_recovery_s": self.milvus_answers - self.server_up,
            "recovery_after_milvus_s": (self.service_ok - self.milvus_answers) if self.service_ok else float("nan"),
            "recovery_after_health_s": (self.service_ok - self.server_up) if self.service_ok else float("nan"),
            "failed_after_recovery": sum(r.status != 200 for r in self.after_recovery()),
        }


class _Service:
    """The app under real uvicorn in a thread on a free loopback port."""

    def __init__(self, app: Any) -> None:
        import socket

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Service:
        import httpx

        self.thread.start()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the service did not become ready")

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _probe(uri: str, collection: str, dim: int) -> bool:
    """A fresh client's search answers (Milvus itself serves again)."""
    from pymilvus import MilvusClient

    try:
        client = MilvusClient(uri=uri, timeout=1.0, alias=f"probe-{uuid.uuid4().hex}")
    except Exception:  # noqa: BLE001 - not up yet
        return False
    try:
        client.search(collection, data=[[0.0] * dim], limit=1, timeout=1.0, retry_times=0)
        return True
    except Exception:  # noqa: BLE001 - not serving yet
        return False
    finally:
        client.close()


def run_outage(
    server: Any, bundle: Path, *, clients: int = 4, deadline_s: float = 1.0, client_timeout_s: float = 10.0,
    before_s: float = 2.0, freeze_s: float = 3.0, down_s: float = 3.0, after_s: float = 3.0,
    recovery_limit_s: float = 120.0,
) -> OutageRun:
    """Serve ``bundle`` from ``server`` (a started :class:`tests.milvus_server.MilvusStandalone`),
    load it with ``clients`` threads, freeze the server (SIGSTOP: it accepts connections but never
    answers, the case only deadlines bound), then kill it, restart it, and record every request."""
    import httpx

    from index.bundle.format import read_manifest
    from index.engines.milvus_index import MilvusTarget, publish
    from service.app import create_app
    from service.settings import Settings

    manifest = read_manifest(bundle)
    target = MilvusTarget(uri=server.uri)
    publish(bundle, target)
    settings = Settings.model_validate({
        "environment": "development", "bundles_dir": bundle.parent, "bundle": bundle.name,
        "index_backend": "milvus", "milvus_uri": server.uri, "milvus_timeout_s": deadline_s,
    })
    run = OutageRun(deadline_s=deadline_s, client_timeout_s=client_timeout_s)
    stop = threading.Event()
    lock = threading.Lock()

    def load(worker: int) -> None:
        with httpx.Client(timeout=client_timeout_s) as http:
            i = 0
            while not stop.is_set():
                i += 1
                query = f"{WORDS[(worker + i) % len(WORDS)]} {WORDS[(3 * i) % len(WORDS)]} {worker}-{i}"
                sent = time.monotonic()
                try:
                    response = http.post(url + "/v1/search/text", json={"query": query, "k": 5})
                    body = response.json() if response.headers.get("content-type", "").endswith("json") else {}
                    record = Request(sent, time.monotonic(), response.status_code,
                                     str(body.get("type", "")).rsplit(":", 1)[-1] or None,
                                     response.headers.get("retry-after"), detail=body.get("detail"))
                except httpx.HTTPError as err:
                    record = Request(sent, time.monotonic(), None, error=type(err).__name__)
                with lock:
                    run.requests.append(record)
                time.sleep(0.02)

    with _Service(create_app(settings)) as service:
        url = service.url
        threads = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(clients)]
        for thread in threads:
            thread.start()
        time.sleep(before_s)
        if freeze_s > 0 and server.pid is not None:
            run.frozen = time.monotonic()
            os.kill(server.pid, signal.SIGSTOP)
            time.sleep(freeze_s)  # shorter than the session TTL (5 s): the server survives its freeze
            run.thawed = time.monotonic()
            os.kill(server.pid, signal.SIGCONT)
        run.killed = time.monotonic()
        server.kill()
        time.sleep(down_s)
        run.restarted = time.monotonic()
        server.start()
        run.server_up = time.monotonic()
        collection = target.collection(manifest.bundle_id, "audio")
        limit = run.server_up + recovery_limit_s
        while not _probe(server.uri, collection, manifest.embed_dim) and time.monotonic() < limit:
            time.sleep(0.05)
        run.milvus_answers = time.monotonic()
        while time.monotonic() < limit:
            with lock:
                ok = [r.done for r in run.requests if r.status == 200 and r.sent >= run.server_up]
            if ok:
                run.service_ok = min(ok)
                break
            time.sleep(0.05)
        time.sleep(after_s)
        stop.set()
        for thread in threads:
            thread.join(client_timeout_s + 5)
    return run


def section(run: OutageRun, *, command: str, clients: int, load_before: float, load_after: float) -> str:
    s = run.summary()
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([
        START,
        "## milvus_outage — Milvus killed and restarted under load (bench/milvus_outage.py)",
        "",
        f"- command: `{command})",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores; Milvus 2.3.5 standalone (`milvus` package) on the same machine",
        f"- date: {now}; 1-min load average before / after: {load_before:.1f} / {load_after:.1f}",
        f"- load: {clients} client threads sending unique text searches (k=5) back to back, client timeout "
        f"{run.client_timeout_s:.0f} s; Milvus deadline `TONEARM_MILVUS_TIMEOUT_S={run.deadline_s:g}`; the server is "
        "frozen (SIGSTOP) 3 s, then SIGKILLed, left down 3 s, and started again on its data (session TTL 5 s); "
        "after a failure to answer, Milvus calls fail at once for 1 s, then one call probes it.",
        "- targets: first 503 within the deadline, 0 hung requests, recovery ≤ 5 s after Milvus is back.",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| requests (200 / 503 index-unavailable / other 5xx / hung) | {s['requests']} ({s['ok']} / "
        f"{s['index_unavailable']} / {s['other_5xx']} / {s['hung']}) |",
        f"| 503s without Retry-After | {s['without_retry_after']} |",
        f"| first 503 after the kill | {s['first_503_s']:.3f} s |",
        f"| 503 latency p50 / max | {s['503_latency_p50_s']:.3f} / {s['503_latency_max_s']:.3f} s |",
        f"| while frozen (SIGSTOP, 3 s): 503s, max latency | {s['frozen_503']}, {s['frozen_503_max_s']:.3f} s |",
        f"| server restart (process start → health check) | {s['server_restart_s']:.1f} s |",
        f"| Milvus's own recovery (health check → a fresh client's search answers) | {s['milvus_recovery_s']:.1f} s |",
        f"| **service recovery after Milvus answers again** | **{_recovery(s['recovery_after_milvus_s'])}** |",
        f"| service recovery after the health check | {s['recovery_after_health_s']:.1f} s |",
        f"| failed requests after recovery | {s['failed_after_recovery']} |",
        END,
    ])


def _recovery(seconds: float) -> str:
    """The service's lag behind Milvus; negative: its (already connected) client answered before a
    fresh probe client had even connected."""
    if seconds <= 0:
        return f"0 s (answered {-seconds:.2f} s before a fresh client)"
    return f"{seconds:.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="an exported bundle directory")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=2.0, help="TONEARM_MILVUS_TIMEOUT_S")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/BENCHMARKS.md")
    args = parser.parse_args()
    from tests.milvus_server import MilvusStandalone

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="milvus-outage-") as work:
        server = MilvusStandalone(Path(work) / "milvus")
        server.start()
        try:
            run = run_outage(server, args.bundle.resolve(), clients=args.clients, deadline_s=args.deadline)
        finally:
            server.kill()
    from index.bundle.format import read_manifest

    clips = read_manifest(args.bundle).audio_index.ntotal
    command = (f"quiet-run python bench/milvus_outage.py --bundle BUNDLE --clients {args.clients} "
               f"--deadline {args.deadline:g}` (BUNDLE: {clips} clips")
    publish_section(section(run, command=command, clients=args.clients, load_before=load_before,
                            load_after=os.getloadavg()[0]), start=START, end=END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
