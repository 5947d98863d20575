"""Soak: the real service under mixed traffic for a long time, with bundle swaps and dependency
outages injected on a schedule (docs/BENCHMARKS.md, soak section with PNG plots).

`tonearm serve` runs as a subprocess (uvicorn, one worker) with a redis-server of our own and, with
``--backend milvus``, the real Milvus standalone server (tests/milvus_server.py). ``--clients``
threads send closed-loop mixed traffic: cold text queries (unique) and repeated ones in the
bundle's eight languages, ``text:batch`` calls, audio uploads (WAV 16 kHz mono, FLAC 44.1 kHz
stereo, WAV 48 kHz, OGG 22.05 kHz) and consistency diagnostics. On a schedule it activates a
second bundle and rolls back (``--swap-every``), SIGKILLs Redis and restarts it
(``--redis-kill-every``), and with Milvus SIGKILLs and restarts the server (``--milvus-kill-every``).

Recorded per window (``--window``): requests by status (and problem type), p50/p99 latency, the
service's resident memory, threads and open file descriptors, its TCP connections to Redis and to
Milvus. Resident memory is sampled every second; a window's figure is the median of its samples
(its peak is recorded beside it), because RSS jumps for seconds while a bundle swap holds two
bundles or a burst of uploads is decoded — one instantaneous reading per window made the verdict
depend on where that reading fell (a 30-min soak read +6.8 % on a last sample taken in such a
moment while its windows' level was flat). Targets (exit status 1 when one is missed): no failed
request other than 503 ``index-unavailable`` during a Milvus outage (kill → back +
``--recovery-s``); during a Redis outage none at all; resident memory after ``--warmup`` grows
≤ ``--max-rss-growth`` (5 %: the last window's median against the first window's after warm-up);
threads and descriptors flat (last window ≤ the first after warm-up + 2 threads / + 8 fds); p99
of the last window within ``--max-p99-growth`` (20 %) of the first after warm-up; after each
outage the service answers again within ``--recovery-s`` (5 s) of the dependency being back.

    flock /tmp/tonearm-heavy.lock python bench/soak.py --bundle BUNDLE --minutes 30 [--backend milvus]
    python bench/soak.py --bundle BUNDLE --seconds 40 --window 8 --swap-every 16 --no-write   # short mode

A short mode (``--seconds``) is what tests/bench/test_soak.py runs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.benchlib import cpu_model, publish_section  # noqa: E402

TOKEN = "soak-admin-token-0123456789abcdef"
RESULTS = ROOT / "docs" / "results" / "soak"
RSS_SAMPLE_S = 1.0
"""Seconds between resident-memory samples (a window reports their median and peak)."""
WORDS = {
    "eng": ["a dog barks", "rain on a roof", "a siren passes", "birds sing", "a door slams", "wind howls"],
    "fra": ["un chien aboie", "la pluie tombe", "une sirène passe", "des oiseaux chantent"],
    "deu": ["ein Hund bellt", "Regen fällt", "eine Sirene heult", "Vögel singen"],
    "spa": ["un perro ladra", "llueve fuerte", "pasa una sirena", "cantan pájaros"],
    "nld": ["een hond blaft", "regen valt", "een sirene gaat voorbij"],
    "cat": ["un gos borda", "plou", "passa una sirena"],
    "jpn": ["犬が吠える", "雨が降る", "サイレンが鳴る"],
    "zho": ["狗在叫", "下雨了", "警笛响起"],
}
KINDS = ("text_cold", "text_repeat", "batch", "audio", "consistency")
WEIGHTS = (0.35, 0.25, 0.10, 0.20, 0.10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- process metrics


def proc_status(pid: int) -> dict[str, int]:
    """Resident memory (KiB), threads and open descriptors of ``pid`` (Linux /proc)."""
    out = {"rss_kib": 0, "threads": 0, "fds": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_kib"] = int(line.split()[1])
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


def tcp_connections(pid: int, port: int) -> int:
    """Established TCP connections of process ``pid`` to local port ``port`` (its sockets' inodes
    matched against /proc/net/tcp{,6})."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return 0
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "01" and int(parts[2].rsplit(":", 1)[1], 16) == port \
                    and parts[9] in inodes:
                count += 1
    return count


# ----------------------------------------------------------------------------- traffic


@dataclass
class Sample:
    t: float
    """Seconds since the soak started (request sent)."""
    kind: str
    status: int
    """HTTP status; -1: no answer (client timeout or transport error)."""
    ms: float
    problem: str | None = None


def audio_payloads() -> list[bytes]:
    """Uploads in several formats and rates: WAV 16 kHz mono, FLAC 44.1 kHz stereo, WAV 48 kHz, OGG."""
    import soundfile as sf

    rng = np.random.default_rng(0)
    out = []
    for rate, channels, seconds, fmt in ((16_000, 1, 3.0, "WAV"), (44_100, 2, 2.0, "FLAC"),
                                         (48_000, 1, 1.5, "WAV"), (22_050, 1, 2.0, "OGG")):
        n = int(rate * seconds)
        tone = 0.3 * np.sin(2 * np.pi * rng.uniform(200, 2000) * np.arange(n) / rate).astype(np.float32)
        data = np.stack([tone] * channels, axis=1) if channels > 1 else tone
        buffer = io.BytesIO()
        sf.write(buffer, data, rate, format=fmt)
        out.append(buffer.getvalue())
    return out


def client_loop(url: str, worker: int, started: float, stop: threading.Event, samples: list[Sample],
                audio: list[bytes], languages: list[str], timeout_s: float) -> None:
    import httpx

    rng = random.Random(worker)
    langs = [lang for lang in languages if lang in WORDS] or ["eng"]
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        i = 0
        while not stop.is_set():
            kind = rng.choices(KINDS, WEIGHTS)[0]
            lang = rng.choice(langs)
            phrase = rng.choice(WORDS[lang])
            sent = time.monotonic()
            try:
                if kind == "text_cold":
                    r = client.post("/v1/search/text", json={"query": f"{phrase} {worker}-{i}", "k": 10})
                elif kind == "text_repeat":
                    r = client.post("/v1/search/text", json={"query": phrase, "k": 10, "lang": lang})
                elif kind == "batch":
                    queries = [f"{rng.choice(WORDS[rng.choice(langs)])} {worker}-{i}-{j}" for j in range(8)]
                    r = client.post("/v1/search/text:batch", json={"queries": queries, "k": 5})
                elif kind == "audio":
                    r = client.post("/v1/search/audio?k=5", files={"file": ("clip", rng.choice(audio))})
                else:
                    captions = {code: rng.choice(WORDS[code]) for code in rng.sample(langs, min(3, len(langs)))}
                    r = client.post("/v1/diagnostics/consistency", json={"captions": captions, "k": 10})
                problem = None
                if r.status_code != 200:
                    try:
                        problem = re.split(r"[/:]", str(r.json().get("type", "")))[-1] or None  # urn:…:slug
                    except ValueError:
                        problem = None
                samples.append(Sample(sent - started, kind, r.status_code, 1000 * (time.monotonic() - sent), problem))
            except Exception as err:  # noqa: BLE001 - a request with no answer is what a soak looks for
                samples.append(Sample(sent - started, kind, -1, 1000 * (time.monotonic() - sent), type(err).__name__))
            i += 1


# ----------------------------------------------------------------------------- dependencies


class Redis:
    def __init__(self, binary: str) -> None:
        self.binary, self.port = binary, _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        import redis

        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
            self.process = None


@dataclass
class Event:
    t: float
    what: str
    """activate | rollback | redis-kill | redis-back | milvus-kill | milvus-back | service-answers"""
    detail: str = ""


@dataclass
class Outage:
    dependency: str
    killed: float
    back: float = 0.0
    """Dependency answering again (Redis ping / Milvus health check)."""
    first_failure: float | None = None
    """Seconds from the kill to the first failed request (Milvus: a 503)."""
    recovered_after_s: float | None = None
    """Seconds from ``back`` to the first 200 sent after it."""


# ----------------------------------------------------------------------------- the run


@dataclass
class Config:
    bundle: Path
    backend: str = "faiss"
    seconds: float = 1800.0
    window_s: float = 60.0
    warmup_s: float = 300.0
    clients: int = 6
    swap_every_s: float = 120.0
    redis_kill_every_s: float = 600.0
    redis_down_s: float = 5.0
    milvus_kill_every_s: float = 600.0
    milvus_down_s: float = 5.0
    milvus_timeout_s: float = 2.0
    recovery_s: float = 5.0
    client_timeout_s: float = 30.0
    max_rss_growth: float = 0.05
    max_p99_growth: float = 0.20


@dataclass
class Window:
    start: float
    end: float
    statuses: dict[str, int] = field(default_factory=dict)
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    rss_mib: float = 0.0
    threads: int = 0
    fds: int = 0
    redis_connections: int = 0
    milvus_connections: int = 0
    rss_peak_mib: float = 0.0
    """``rss_mib`` is the median of the window's once-a-second samples; this is their maximum."""


@dataclass
class SoakResult:
    config: dict[str, Any]
    windows: list[Window]
    events: list[Event]
    outages: list[Outage]
    failures: list[dict[str, Any]]
    targets: dict[str, tuple[bool, str]]
    requests: int

    @property
    def ok(self) -> bool:
        return all(met for met, _ in self.targets.values())


def _bundle_copy(src: Path, parent: Path, bundle_id: str) -> Path:
    """``src`` republished under another id (same encoders and indices: the gate passes it)."""
    from index.bundle import format as fmt

    manifest = fmt.read_manifest(src)
    with fmt.staged_bundle(parent, bundle_id) as staging:
        for rel in manifest.files:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, staging / rel)
        return fmt.publish(staging, manifest.model_copy(update={"bundle_id": bundle_id}))


def run_soak(cfg: Config, work: Path) -> SoakResult:
    import httpx

    from index.bundle.format import read_manifest

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: apt-get install redis-server")
    bundles = work / "bundles"
    stamp = f"{int(time.time())}"
    main_id, other_id = f"soak-a-{stamp}", f"soak-b-{stamp}"
    _bundle_copy(cfg.bundle, bundles, main_id)
    _bundle_copy(cfg.bundle, bundles, other_id)
    languages = list(read_manifest(cfg.bundle).languages)
    redis_server = Redis(binary)
    redis_server.start()
    milvus = None
    env_extra: dict[str, str] = {}
    if cfg.backend == "milvus":
        from index.engines.milvus_index import MilvusTarget, publish
        from tests.milvus_server import MilvusStandalone

        milvus = MilvusStandalone(work / "milvus")
        milvus.start()
        target = MilvusTarget(uri=milvus.uri, timeout_s=30.0)
        for bundle_id in (main_id, other_id):
            publish(bundles / bundle_id, target)
        env_extra = {"TONEARM_INDEX_BACKEND": "milvus", "TONEARM_MILVUS_URI": milvus.uri,
                     "TONEARM_MILVUS_TIMEOUT_S": str(cfg.milvus_timeout_s)}
    port = _free_port()
    settings = {
        "TONEARM_ENVIRONMENT": "production", "TONEARM_BUNDLES_DIR": str(bundles), "TONEARM_BUNDLE": main_id,
        "TONEARM_REDIS_URL": redis_server.url, "TONEARM_ADMIN_TOKEN": TOKEN, "TONEARM_HOME": str(work / "home"),
        "TONEARM_KEY_PREFIX": f"soak{stamp}", "TONEARM_PUBSUB_CHANNEL": f"soak{stamp}:activations",
        "TONEARM_GATE_MIN_CLIPS": "1", **env_extra,
    }
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TONEARM_")}, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), **settings}
    log_path = work / "service.log"
    with log_path.open("wb") as log_file:
        service = subprocess.Popen([sys.executable, "-m", "tonearm.cli", "serve", "--host", "127.0.0.1",
                                    "--port", str(port)], cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    samples: list[Sample] = []
    events: list[Event] = []
    outages: list[Outage] = []
    windows: list[Window] = []
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 300
        while True:
            if service.poll() is not None:
                raise SystemExit(f"the service exited:\n{log_path.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the service never became ready")
            time.sleep(0.2)
        audio = audio_payloads()
        started = time.monotonic()
        threads = [threading.Thread(target=client_loop, daemon=True,
                                    args=(url, w, started, stop, samples, audio, languages, cfg.client_timeout_s))
                   for w in range(cfg.clients)]
        for thread in threads:
            thread.start()

        def now() -> float:
            return time.monotonic() - started

        def admin(path: str, body: dict | None = None) -> str:
            try:
                r = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300)
                return f"{r.status_code}" + ("" if r.status_code == 200 else f" {r.text[:200]}")
            except httpx.HTTPError as err:
                return f"error {err!r}"

        schedule = _schedule(cfg)
        restarts: list[threading.Thread] = []
        rss_samples: list[float] = []
        next_rss = 0.0
        next_window = cfg.window_s
        window_start = 0.0
        while now() < cfg.seconds:
            while schedule and schedule[0][0] <= now():
                when, what = schedule.pop(0)
                if what in ("activate", "rollback") and any(not o.back for o in outages if o.dependency == "milvus"):
                    schedule.insert(0, (when + 1.0, what))  # no swap while Milvus is restarting: after it
                    break
                if what == "activate":
                    events.append(Event(now(), what, admin("/v1/bundles/activate", {"bundle_id": other_id})))
                elif what == "rollback":
                    events.append(Event(now(), what, admin("/v1/bundles/rollback")))
                elif what == "redis-kill":
                    events.append(Event(now(), what))
                    outages.append(Outage("redis", now()))
                    redis_server.kill()
                elif what == "redis-back":
                    redis_server.start()
                    outages[-1].back = now()
                    events.append(Event(now(), what))
                elif what == "milvus-kill" and milvus is not None:
                    events.append(Event(now(), what))
                    outages.append(Outage("milvus", now()))
                    milvus.kill()
                elif what == "milvus-back" and milvus is not None:
                    outage = outages[-1]  # restarted beside the traffic: windows keep closing meanwhile
                    restart = threading.Thread(target=_restart_milvus, daemon=True,
                                               args=(milvus, outage, events, now))
                    restart.start()
                    restarts.append(restart)
            if now() >= next_rss:
                rss_samples.append(proc_status(service.pid)["rss_kib"] / 1024)
                next_rss = now() + RSS_SAMPLE_S
            if now() >= next_window:
                windows.append(_window(samples, window_start, now(), service.pid, redis_server.port,
                                       milvus.ports["proxy_port"] if milvus else None, rss_samples))
                rss_samples = []
                window_start, next_window = now(), next_window + cfg.window_s
            time.sleep(0.05)
        for restart in restarts:
            restart.join(300)
        if now() - window_start > cfg.window_s / 4:
            windows.append(_window(samples, window_start, now(), service.pid, redis_server.port,
                                   milvus.ports["proxy_port"] if milvus else None, rss_samples))
        stop.set()
        for thread in threads:
            thread.join(cfg.client_timeout_s + 5)
    finally:
        stop.set()
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=30)
        except subprocess.TimeoutExpired:
            service.kill()
        redis_server.kill()
        if milvus is not None:
            milvus.kill()
    return _judge(cfg, samples, windows, events, outages)


def _restart_milvus(milvus: Any, outage: Outage, events: list[Event], now: Any) -> None:
    """Start Milvus again on its data; the outage is over ("back") once a fresh client's search of
    the active caption alias answers — Milvus's own recovery (its session TTL, reloading the
    collections) is not the service's."""
    from pymilvus import MilvusClient

    milvus.start()
    events.append(Event(now(), "milvus-started"))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            client = MilvusClient(uri=milvus.uri, timeout=2.0)
            try:
                fields = client.describe_collection("tonearm_active_text")["fields"]
                dim = int(next(f for f in fields if f["name"] == "vector")["params"]["dim"])
                client.search("tonearm_active_text", data=[[1.0] + [0.0] * (dim - 1)], limit=1, timeout=2.0,
                              retry_times=0)
            finally:
                client.close()
            break
        except Exception:  # noqa: BLE001 - not back yet
            time.sleep(0.25)
    outage.back = now()
    events.append(Event(now(), "milvus-back"))


def _schedule(cfg: Config) -> list[tuple[float, str]]:
    """(time, action): an activation every ``swap_every`` (rollback half a period later), Redis and
    Milvus outages a quarter period off the swaps, never overlapping one."""
    out: list[tuple[float, str]] = []
    t = cfg.swap_every_s / 2
    while t < cfg.seconds - cfg.window_s / 2:
        out += [(t, "activate"), (t + cfg.swap_every_s / 2, "rollback")]
        t += cfg.swap_every_s
    for dependency, every, down, offset in (("redis", cfg.redis_kill_every_s, cfg.redis_down_s, 0.25),
                                            ("milvus", cfg.milvus_kill_every_s if cfg.backend == "milvus" else 0,
                                             cfg.milvus_down_s, 0.75)):
        if every <= 0:
            continue
        t = every / 2 + offset * cfg.swap_every_s
        while t + down < cfg.seconds - cfg.window_s / 2:
            out += [(t, f"{dependency}-kill"), (t + down, f"{dependency}-back")]
            t += every
    return sorted(out)


def _window(samples: list[Sample], start: float, end: float, pid: int, redis_port: int,
            milvus_port: int | None, rss_samples: list[float]) -> Window:
    inside = [s for s in list(samples) if start <= s.t < end]
    statuses: dict[str, int] = {}
    for s in inside:
        key = str(s.status) + (f" {s.problem}" if s.status != 200 and s.problem else "")
        statuses[key] = statuses.get(key, 0) + 1
    ok = np.array([s.ms for s in inside if s.status == 200]) if inside else np.zeros(0)
    p50, p99 = (np.percentile(ok, [50, 99]) if len(ok) else (0.0, 0.0))
    status = proc_status(pid)
    rss = rss_samples or [status["rss_kib"] / 1024]
    return Window(start=round(start, 2), end=round(end, 2), statuses=statuses, p50_ms=float(p50), p99_ms=float(p99),
                  rss_mib=float(np.median(rss)), threads=status["threads"], fds=status["fds"],
                  redis_connections=tcp_connections(pid, redis_port),
                  milvus_connections=tcp_connections(pid, milvus_port) if milvus_port else 0,
                  rss_peak_mib=float(max(rss)))


def _judge(cfg: Config, samples: list[Sample], windows: list[Window], events: list[Event],
           outages: list[Outage]) -> SoakResult:
    def excused(s: Sample) -> bool:
        """A documented 503 during a Milvus outage: answered after the kill (in flight then, or sent
        later) and sent before Milvus was back + the recovery allowance."""
        return s.status == 503 and s.problem == "index-unavailable" and any(
            o.dependency == "milvus" and o.killed <= s.t + s.ms / 1000 and s.t <= (o.back or cfg.seconds) + cfg.recovery_s
            for o in outages)

    failures = [asdict(s) for s in samples if s.status != 200 and not excused(s)]
    for o in outages:
        failed = [s.t for s in samples if s.t >= o.killed and s.status != 200]
        o.first_failure = round(min(failed) - o.killed, 3) if failed and min(failed) < (o.back or o.killed) else None
        after = [s.t + s.ms / 1000 for s in samples if o.back and s.t >= o.back and s.status == 200]
        o.recovered_after_s = round(max(0.0, min(after) - o.back), 3) if after else None
    warm = [w for w in windows if w.start >= cfg.warmup_s] or windows[-2:]
    targets: dict[str, tuple[bool, str]] = {}
    targets["failed requests"] = (not failures, f"{len(failures)} failed (excluding 503 index-unavailable during "
                                                f"Milvus outages) of {len(samples)}")
    if warm:
        base, last = warm[0], warm[-1]
        growth = last.rss_mib / base.rss_mib - 1 if base.rss_mib else 0.0
        peak = max(w.rss_peak_mib for w in warm)
        targets["memory growth after warm-up"] = (
            growth <= cfg.max_rss_growth,
            f"window medians {base.rss_mib:.0f} → {last.rss_mib:.0f} MiB ({100 * growth:+.1f} %, "
            f"target ≤ {100 * cfg.max_rss_growth:.0f} %); highest sample after warm-up {peak:.0f} MiB")
        targets["threads flat"] = (last.threads <= base.threads + 2, f"{base.threads} → {last.threads}")
        targets["file descriptors flat"] = (last.fds <= base.fds + 8, f"{base.fds} → {last.fds}")
        first_p99 = warm[0].p99_ms
        targets["p99 last vs first window"] = (
            last.p99_ms <= first_p99 * (1 + cfg.max_p99_growth),
            f"{first_p99:.0f} → {last.p99_ms:.0f} ms (target ≤ +{100 * cfg.max_p99_growth:.0f} %)")
    if any(o.dependency == "milvus" for o in outages):
        bound_ms = 1000 * (cfg.milvus_timeout_s + 2 * 0.5 + 2.0)  # deadline + default probes + HTTP/encoder slack
        slowest = max((s.ms for s in samples if excused(s)), default=0.0)
        targets["503s within the deadline"] = (slowest <= bound_ms, f"slowest 503 {slowest:.0f} ms "
                                                                    f"(bound {bound_ms:.0f} ms)")
    late = [o for o in outages if o.recovered_after_s is None or o.recovered_after_s > cfg.recovery_s]
    targets["recovery after each outage"] = (
        not late, ", ".join(f"{o.dependency} {o.recovered_after_s} s" for o in outages) or "no outage injected")
    bad_events = [e for e in events if e.what in ("activate", "rollback") and not e.detail.startswith("200")]
    targets["activations and rollbacks"] = (not bad_events, f"{sum(e.what in ('activate', 'rollback') for e in events)} "
                                                            f"done, {len(bad_events)} failed")
    return SoakResult(config={k: str(v) for k, v in asdict(cfg).items()}, windows=windows, events=events,
                      outages=outages, failures=failures[:50], targets=targets, requests=len(samples))


# ----------------------------------------------------------------------------- report


def plot(result: SoakResult, out_dir: Path, backend: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    minutes = [w.end / 60 for w in result.windows]
    paths = []
    for name, series in (("latency", (("p50 ms", [w.p50_ms for w in result.windows]),
                                      ("p99 ms", [w.p99_ms for w in result.windows]))),
                         ("memory", (("resident MiB, window median", [w.rss_mib for w in result.windows]),
                                     ("resident MiB, window peak", [w.rss_peak_mib for w in result.windows]))),
                         ("resources", (("threads", [w.threads for w in result.windows]),
                                        ("open fds", [w.fds for w in result.windows])))):
        fig, ax = plt.subplots(figsize=(8, 3.2))
        for label, values in series:
            ax.plot(minutes, values, marker="o", markersize=3, label=label)
        for e in result.events:
            color = {"activate": "tab:green", "rollback": "tab:olive", "redis-kill": "tab:red",
                     "milvus-kill": "tab:purple"}.get(e.what)
            if color:
                ax.axvline(e.t / 60, color=color, alpha=0.35, linewidth=1)
        ax.set_xlabel("minutes (lines: green activate, olive rollback, red Redis kill, purple Milvus kill)")
        ax.set_title(f"soak ({backend}): {name} per window")
        ax.legend(loc="best")
        if name == "memory":
            ax.set_ylim(bottom=0)
        fig.tight_layout()
        path = out_dir / f"soak_{backend}_{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def section(result: SoakResult, cfg: Config, *, command: str, load: tuple[float, float], plots: list[Path]) -> str:
    start, end = f"<!-- bench:soak_{cfg.backend}:start -->", f"<!-- bench:soak_{cfg.backend}:end -->"
    lines = [
        start,
        f"## soak ({cfg.backend}) — {cfg.seconds / 60:.1f} min of mixed traffic with swaps and outages",
        "",
        f"- command: `{command}`",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores; date {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
        f"load average before {load[0]:.2f} / after {load[1]:.2f} (1 min)",
        f"- traffic: {cfg.clients} closed-loop clients (cold and repeated text in 8 languages, text:batch of 8, "
        "audio uploads WAV/FLAC/OGG at 16–48 kHz, consistency diagnostics); activation + rollback every "
        f"{cfg.swap_every_s:g} s; "
        + (f"Redis SIGKILLed every {cfg.redis_kill_every_s:g} s for {cfg.redis_down_s:g} s"
           if cfg.redis_kill_every_s > 0 else "Redis not killed")
        + (f"; Milvus SIGKILLed every {cfg.milvus_kill_every_s:g} s for {cfg.milvus_down_s:g} s (+ its restart)"
           if cfg.backend == "milvus" else ""),
        f"- {result.requests} requests; verdict: **{'all targets met' if result.ok else 'TARGET MISSED'}**",
        "",
        "| target | met | measured |",
        "|---|:-:|---|",
        *[f"| {name} | {'yes' if met else '**no**'} | {text} |" for name, (met, text) in result.targets.items()],
        "",
        "| window end (min) | requests by status | p50 / p99 ms | RSS MiB median / peak | threads | fds "
        "| Redis / Milvus conns |",
        "|---:|---|---:|---:|---:|---:|---:|",
        *[f"| {w.end / 60:.1f} | {', '.join(f'{k}: {v}' for k, v in sorted(w.statuses.items()))} | "
          f"{w.p50_ms:.0f} / {w.p99_ms:.0f} | {w.rss_mib:.0f} / {w.rss_peak_mib:.0f} | {w.threads} | {w.fds} | "
          f"{w.redis_connections} / {w.milvus_connections} |" for w in result.windows],
        "",
        *[f"- outage {o.dependency} at {o.killed:.0f} s, back (answering a fresh client) at {o.back:.0f} s: "
          + (f"first failed request {o.first_failure} s after the kill" if o.first_failure is not None
             else "no request failed")
          + f"; the service answered {o.recovered_after_s} s after the dependency was back" for o in result.outages],
        "",
        *[f"![soak {cfg.backend} {p.stem}](results/soak/{p.name})" for p in plots],
        end,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="an exported bundle (copied twice: a and b)")
    parser.add_argument("--backend", choices=("faiss", "milvus"), default="faiss")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seconds", type=float, default=None, help="short mode: run this many seconds instead")
    parser.add_argument("--window", type=float, default=60.0, help="seconds per window")
    parser.add_argument("--warmup", type=float, default=300.0, help="seconds before the memory baseline")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--swap-every", type=float, default=120.0)
    parser.add_argument("--redis-kill-every", type=float, default=600.0, help="0: never")
    parser.add_argument("--redis-down", type=float, default=5.0)
    parser.add_argument("--milvus-kill-every", type=float, default=600.0, help="0: never (--backend milvus)")
    parser.add_argument("--milvus-down", type=float, default=5.0)
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--max-p99-growth", type=float, default=0.20)
    parser.add_argument("--out", type=Path, default=None, help="write plots and JSON here (default docs/results/soak)")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    cfg = Config(bundle=args.bundle.resolve(), backend=args.backend,
                 seconds=args.seconds if args.seconds else 60 * args.minutes, window_s=args.window,
                 warmup_s=args.warmup, clients=args.clients, swap_every_s=args.swap_every,
                 redis_kill_every_s=args.redis_kill_every, redis_down_s=args.redis_down,
                 milvus_kill_every_s=args.milvus_kill_every, milvus_down_s=args.milvus_down,
                 max_rss_growth=args.max_rss_growth, max_p99_growth=args.max_p99_growth)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tonearm-soak-") as work:
        result = run_soak(cfg, Path(work))
    out_dir = args.out or RESULTS
    plots = plot(result, out_dir, cfg.backend)
    (out_dir / f"soak_{cfg.backend}.json").write_text(json.dumps(
        {"config": result.config, "targets": result.targets, "windows": [asdict(w) for w in result.windows],
         "events": [asdict(e) for e in result.events], "outages": [asdict(o) for o in result.outages],
         "failures": result.failures, "requests": result.requests}, indent=1), encoding="utf-8")
    shown = " ".join(a if " " not in a else repr(a) for a in (argv if argv is not None else sys.argv[1:]))
    command = f"flock /tmp/tonearm-heavy.lock python bench/soak.py {shown}".replace(str(args.bundle), "BUNDLE")
    text = section(result, cfg, command=command, load=(load_before, os.getloadavg()[0]), plots=plots)
    publish_section(text, start=f"<!-- bench:soak_{cfg.backend}:start -->", end=f"<!-- bench:soak_{cfg.backend}:end -->",
                    write=not args.no_write)
    for name, (met, measured) in result.targets.items():
        if not met:
            print(f"target missed: {name}: {measured}", file=sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
