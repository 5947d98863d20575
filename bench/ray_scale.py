"""Benchmark: `tonearm index --ray` throughput with 1 and 2 embedding workers (SPEC §12, issue 22).

A Ray head is started on this machine (loopback, ``--num-cpus`` = the cores, its own temp
dir) and the demo bundle's audio encoder embeds the demo corpus's clips (``--files`` of
them, 5 s WAV) through :func:`index.catalogue.ray_embed.embed_audio_files` — the pass
`tonearm index --ray` runs — once with a pool of 1 actor and once with 2 (one CPU and one
ONNX Runtime thread each). The single-process path (`tonearm index` without ``--ray``, one
ONNX thread) is measured too, as the baseline a worker competes with.

Reported per setup: the wall time of the pass, and its rate — clips / busy time, where busy
time runs from the first embedding call's start to the last one's end (stamped inside the
actors, so the pass's fixed cost — actor start, ONNX session creation — is left out: what a
long job sees). Every file is read once before timing (warm page cache for all setups); a
warm-up pass absorbs the driver's first connection. The cluster is stopped (its process group killed) at
the end.

Two more things say what limits 2 workers on 2 cores: the same work split across **two plain
processes** (no Ray, half the files each, started together: the machine's own two-core
ceiling), and **where the CPU went** during each Ray pass — CPU seconds (utime + stime from
/proc) of the driver (this process), the actors (``ray::`` worker processes), the raylet, the
GCS, Ray's other processes and everything else on the machine, over the pass's wall time.

    quiet-run .venv/bin/python bench/ray_scale.py            # ~4 min, writes docs/BENCHMARKS.md
    python bench/ray_scale.py --bundle B --audio DIR --files 300 --no-write
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # one-machine cluster on loopback

from index.bundle.format import read_manifest  # noqa: E402
from index.catalogue.own_audio import decode_file  # noqa: E402
from index.catalogue.ray_embed import RayOptions, embed_audio_files  # noqa: E402
from index.engines.faiss_index import available_cores  # noqa: E402
from index.runtime.loader import AUDIO_INPUTS, OnnxEncoder, encode_waveforms  # noqa: E402

from benchlib import cpu_model, publish_section  # noqa: E402

START, END = "<!-- bench:ray_scale:start -->", "<!-- bench:ray_scale:end -->"
TARGET = "2 workers ≥ 1.6× one worker's clips/s"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def local_cluster(cpus: int) -> Iterator[tuple[str, str]]:
    """A Ray head on 127.0.0.1 with ``cpus`` CPUs: (address, temp dir); killed (process group) on exit."""
    port, temp = _free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [str(ray), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         f"--num-cpus={cpus}", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}",
         f"--ray-client-server-port={_free_port()}"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("ray start failed")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}", temp
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


def single_process(files: list[Path], model: Path, manifest) -> tuple[float, float]:
    """`tonearm index` without --ray: decode + embed 16 files at a time on one ONNX thread."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    start = time.perf_counter()
    encoder = OnnxEncoder(ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"]), model)
    encoder.check_interface(AUDIO_INPUTS, manifest.embed_dim)
    busy = time.perf_counter()
    for i in range(0, len(files), 16):
        waves = [decode_file(f, manifest.sample_rate) for f in files[i : i + 16]]
        encode_waveforms(encoder, waves, clip_samples=manifest.clip_samples, embed_dim=manifest.embed_dim)
    end = time.perf_counter()
    return end - start, end - busy


def _plain_worker(files: list[Path], model: Path, bundle: Path) -> tuple[float, float]:
    """One of the two plain processes: wall-clock (start, end) of its decode + embed span."""
    manifest = read_manifest(bundle)
    began = time.time()
    single_process(files, model, manifest)
    return began, time.time()


def two_plain_processes(files: list[Path], model: Path, bundle: Path) -> tuple[float, float]:
    """The machine's two-core ceiling: two processes (no Ray), half the files each, started together.
    Busy = first process's span start to last one's end (each includes its session creation)."""
    halves = [files[: len(files) // 2], files[len(files) // 2 :]]
    start = time.perf_counter()
    with get_context("spawn").Pool(2) as pool:
        spans = pool.starmap(_plain_worker, [(half, model, bundle) for half in halves])
    wall = time.perf_counter() - start
    return wall, max(end for _, end in spans) - min(began for began, _ in spans)


CLK_TCK = os.sysconf("SC_CLK_TCK")
CPU_GROUPS = ("driver", "actors", "raylet", "gcs", "other Ray", "rest of machine")


def _process_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (cmdline, utime + stime ticks) of every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        out[int(entry.name)] = (cmd, int(fields[11]) + int(fields[12]))
    return out


def _machine_ticks() -> int:
    """Busy ticks of all CPUs (/proc/stat: everything but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4]


def _group(pid: int, cmd: str, ray_temp: str) -> str:
    if pid == os.getpid():
        return "driver"
    if cmd.startswith("ray::"):
        return "actors"
    if "raylet" in cmd.split(" ")[0]:
        return "raylet"
    if "gcs_server" in cmd.split(" ")[0]:
        return "gcs"
    return "other Ray" if ray_temp in cmd else ""


@contextmanager
def cpu_split(ray_temp: str) -> Iterator[dict[str, float]]:
    """CPU seconds by :data:`CPU_GROUPS` while the block runs (filled in on exit)."""
    before, machine = _process_ticks(), _machine_ticks()
    split: dict[str, float] = {}
    yield split
    after, machine = _process_ticks(), _machine_ticks() - machine
    ticks = dict.fromkeys(CPU_GROUPS, 0)
    for pid, (cmd, now) in after.items():
        group = _group(pid, cmd, ray_temp)
        if group:
            ticks[group] += now - before.get(pid, (cmd, 0))[1]
    ticks["rest of machine"] = max(0, machine - sum(ticks.values()))
    split.update({group: value / CLK_TCK for group, value in ticks.items()})


def on_ray(files: list[Path], model: Path, manifest, address: str, workers: int) -> tuple[float, float]:
    """The --ray pass over ``files`` with a pool of ``workers`` actors: (wall, busy) seconds."""
    start = time.perf_counter()
    done = embed_audio_files(
        files, model.read_bytes(), decode=decode_file, embed_dim=manifest.embed_dim,
        sample_rate=manifest.sample_rate, clip_samples=manifest.clip_samples, policy="chunk",
        options=RayOptions(address=address, workers=workers),
    )
    wall = time.perf_counter() - start
    assert not any(done.errors) and done.workers == workers, (done.workers, workers)
    return wall, done.busy_s


def run(args: argparse.Namespace) -> tuple[list[dict], dict]:
    manifest = read_manifest(args.bundle)
    files = sorted(Path(args.audio).rglob("*.wav"))[: args.files]
    for path in files:  # warm the page cache for every setup alike
        path.read_bytes()
    model = args.bundle / manifest.audio_encoder.file
    rows = []

    def row(setup: str, seconds: tuple[float, float], **extra: object) -> None:
        rows.append({"setup": setup, "wall": seconds[0], "busy": seconds[1], "rate": len(files) / seconds[1],
                     **extra})
        print(rows[-1], flush=True)

    row("single process (no Ray), 1 ONNX thread", single_process(files, model, manifest))
    row("two plain processes (no Ray), half the files each", two_plain_processes(files, model, args.bundle))
    with local_cluster(args.cpus) as (address, temp):
        on_ray(files[:64], model, manifest, address, 2)  # warm-up: driver connect, first worker processes
        for workers in (1, 2):
            with cpu_split(temp) as split:
                seconds = on_ray(files, model, manifest, address, workers)
            row(f"Ray, {workers} worker{'s' * (workers > 1)}", seconds, workers=workers, cpu=split)
        import ray

        ray.shutdown()
    return rows, {"n": len(files), "seconds": manifest.clip_seconds, "model_mb": model.stat().st_size / 1e6}


def markdown(rows: list[dict], info: dict, *, command: str, load: tuple[float, float], cpus: int) -> str:
    one = next(r for r in rows if r.get("workers") == 1)
    lines = [
        START,
        "## ray_scale — `tonearm index --ray`: clips/s with 1 and 2 workers (bench/ray_scale.py)",
        "",
        f"- command: `{command}`",
        f"- machine: {cpu_model()}, {available_cores()} cores; Ray head on loopback with {cpus} CPUs "
        "(one node; each worker = one actor, 1 CPU, one ONNX Runtime thread)",
        f"- date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; 1-min load average before / after: "
        f"{load[0]:.1f} / {load[1]:.1f}",
        f"- work: {info['n']} WAV clips of the demo corpus ({info['seconds']:g} s, 16 kHz), the demo bundle's "
        f"audio encoder ({info['model_mb']:.1f} MB ONNX); decode + embed, 16 files per actor call. "
        f"Target: {TARGET}.",
        "",
        "| setup | wall of the pass (s) | busy (s) | clips/s (busy) | × 1 worker |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['wall']:.1f} | {r['busy']:.1f} | {r['rate']:.1f} "
                     f"| {r['rate'] / one['rate']:.2f} |")
    plain = next(r for r in rows if r["setup"].startswith("two plain"))
    two = next(r for r in rows if r.get("workers") == 2)
    lines += [
        "",
        f"Two workers reach {two['rate'] / plain['rate']:.2f}× the two-plain-process ceiling of this machine "
        f"(which is itself {plain['rate'] / rows[0]['rate']:.2f}× one plain process).",
        "",
        f"Where the CPU went during each Ray pass (CPU seconds; wall × {cpus} cores is the capacity):",
        "",
        "| pass | wall (s) | capacity (CPU s) | " + " | ".join(CPU_GROUPS) + " |",
        "|---|---:|---:|" + "---:|" * len(CPU_GROUPS),
    ]
    for r in rows:
        if "cpu" in r:
            lines.append(f"| {r['setup']} | {r['wall']:.1f} | {r['wall'] * cpus:.1f} | "
                         + " | ".join(f"{r['cpu'][g]:.1f}" for g in CPU_GROUPS) + " |")
    lines.append(END)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path,
                        help="bundle whose audio encoder embeds (default: the newest built demo bundle; "
                        "`make serve` builds one)")
    parser.add_argument("--audio", type=Path, help="folder of WAV clips (default: the demo corpus)")
    parser.add_argument("--files", type=int, default=1200)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the Ray head")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    if args.bundle is None or args.audio is None:
        from service.settings import Settings
        from tonearm.demo import demo_root

        root = demo_root(Settings().home)
        built = sorted((root / "bundles").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
        if args.bundle is None and not built:
            parser.error(f"no demo bundle under {root}/bundles: build one with `make serve`, or pass --bundle")
        args.bundle = args.bundle or built[-1].parent
        args.audio = args.audio or root / "corpus" / "audio"
    before = os.getloadavg()[0]
    rows, info = run(args)
    command = "quiet-run .venv/bin/python bench/ray_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = markdown(rows, info, command=command.strip(), load=(before, os.getloadavg()[0]), cpus=args.cpus)
    publish_section(section, start=START, end=END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
