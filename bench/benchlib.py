"""What every benchmark script shares: the machine description and its docs/BENCHMARKS.md section.

Each script owns one section between its own start/end markers; writes take a file lock
so two benchmarks finishing together cannot wipe each other's section.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "docs" / "BENCHMARKS.md"


def cpu_model() -> str:
    """The CPU's marketing name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def bundle_or_demo(path: str | None) -> Path:
    """The bundle a service benchmark serves: ``--bundle`` when given, else the built-in demo bundle
    (built once and cached, as `make serve` does)."""
    if path:
        return Path(path).resolve()
    from service.settings import Settings
    from tonearm.demo import ensure_demo_bundle

    return Path(ensure_demo_bundle(Settings().home))


def publish_section(section: str, *, start: str, end: str, write: bool = True) -> None:
    """Print a benchmark's section and, unless ``write`` is false (``--no-write``), store it."""
    print(section)
    if write:
        write_section(section, start=start, end=end)


def write_section(section: str, path: Path = BENCHMARKS_MD, *, start: str, end: str) -> None:
    """Replace the text between `start` and `end` in `path` with `section` (or append it).

    `section` includes its own markers, so the next run finds and replaces it again.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
        if start in current and end in current:
            before, rest = current.split(start, 1)
            after = rest.split(end, 1)[1].lstrip("\n")
            current = before + section.rstrip("\n") + "\n" + ("\n" + after if after else "")
        else:
            current = current.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
        path.write_text(current, encoding="utf-8")


def random_train_inputs(
    batch: int, *, views: int, seconds: float, sample_rate: int, vocab: int, device: Any, length: int = 24
) -> dict[str, Any]:
    """Random keyword inputs of ``training.loop.TrainStep`` (speed and memory do not depend on content)."""
    import torch

    return {
        "waveform": 0.1 * torch.randn(batch, int(seconds * sample_rate), device=device),
        "input_ids": torch.randint(1, vocab, (views, batch, length), device=device),
        "attention_mask": torch.ones(views, batch, length, dtype=torch.long, device=device),
        "text_mask": torch.ones(views, batch, dtype=torch.bool, device=device),
        "clip_index": torch.arange(batch, device=device),
    }


def synthetic_vectors(n: int, dim: int, seed: int, *, queries: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """``n`` unit vectors around 1000 centres (noise-to-signal 0.5) and ``queries`` perturbed database rows.

    Built in slices of 100k rows so 1 M × 256 needs no more than the result's memory."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, dim)).astype(np.float32)
    x = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 100_000):
        m = min(100_000, n - start)
        x[start : start + m] = centres[rng.integers(0, 1000, m)] + 0.5 * rng.standard_normal((m, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = x[rng.choice(n, queries, replace=False)] + 0.05 * rng.standard_normal((queries, dim)).astype(np.float32)
    return x, q / np.linalg.norm(q, axis=1, keepdims=True)


@contextlib.contextmanager
def moto_s3_bucket(bucket: str, files: Path, *, prefix: str = "shards") -> Iterator[tuple[Any, dict[str, str]]]:
    """A real S3-compatible server (``moto.server``) on a free loopback port with ``bucket`` holding
    every file under ``files`` at ``prefix/…``; yields ``(boto3 client, AWS_* environment)`` (also set
    in ``os.environ`` for this process's fsspec/s3fs) and stops the server on exit."""
    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "rehearsal",
           "AWS_SECRET_ACCESS_KEY": "rehearsal", "AWS_DEFAULT_REGION": "us-east-1"}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.2)
        os.environ.update(env)
        client = boto3.client("s3")
        client.create_bucket(Bucket=bucket)
        for path in sorted(files.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(files).as_posix()}")
        yield client, env
    finally:
        server.terminate()
        server.wait(timeout=10)
