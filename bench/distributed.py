"""Benchmark: distributed training on CPU (gloo) — 1 vs 2 processes, gather-with-grad vs local loss.

Speed: one optimizer step of the real :class:`training.loop.TrainStep` (the ``tiny`` model
of configs/tiny.yaml, random weights, 2-s waveforms, InfoNCE) under DDP on the **same
global batch** (``--batch``): 1 process with the whole batch vs 2 processes with half
each; median step time over ``--steps`` steps after 2 warm-ups, one thread per process,
samples/s = global batch / step time.

Memory: the loss part alone on random unit embeddings (d = 256) with 2 processes, at
growing global batch, ``distributed.loss`` = ``global`` (every rank scores the B × B
logits) vs ``local`` (B/2 × B per rank): bytes the loss keeps for backward (counted
exactly with ``torch.autograd.graph.saved_tensors_hooks``) and the rise of the
process's peak RSS over the step (each configuration in fresh processes; RSS includes
allocator slack, the saved-tensor count does not).

    python bench/distributed.py                      # table + docs/BENCHMARKS.md (~1-2 min)
    python bench/distributed.py --no-write --steps 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import cpu_model, publish_section, random_train_inputs  # noqa: E402

START, END = "<!-- bench/distributed.py -->", "<!-- /bench/distributed.py -->"
DIM = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join(rank: int, world: int, port: int) -> None:
    from training import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if world > 1:
        distributed.init_process_group(torch.device("cpu"), timeout_s=120)


def speed_worker(rank: int, world: int, port: int, batch: int, steps: int, out: str) -> None:
    from training import distributed
    from training.config import load_train_config
    from training.loop import TrainStep, wrap_for_training
    from training.models.dual_encoder import build_dual_encoder
    from training.objectives import build_objective, total_loss
    from training.objectives.base import BuildEnv
    from training.runtime import Runtime

    join(rank, world, port)
    cfg = load_train_config(ROOT / "configs" / "tiny.yaml", [])
    torch.manual_seed(0)
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=cfg.model.text.vocab_size)
    objective = build_objective(cfg.objective, BuildEnv(languages=tuple(cfg.data.languages), embed_dim=model.embed_dim))
    step = wrap_for_training(TrainStep(model, objective), Runtime(device=torch.device("cpu"), rank=rank, world_size=world))
    optimizer = torch.optim.AdamW(step.parameters(), lr=1e-4)
    inputs = random_train_inputs(
        batch // world, views=1, seconds=2.0, sample_rate=cfg.frontend.sample_rate,
        vocab=cfg.model.text.vocab_size, device="cpu",
    )
    times = []
    for index in range(steps + 2):
        distributed.barrier()
        start = time.perf_counter()
        loss = total_loss(step(**inputs))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        distributed.barrier()
        if index >= 2:
            times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(str(statistics.median(times)))
    distributed.destroy_process_group()


def memory_worker(rank: int, world: int, port: int, batch: int, mode: str, out: str) -> None:
    from training import distributed
    from training.config import ObjectiveConfig
    from training.objectives import EmbeddingBatch, build_objective, total_loss
    from training.objectives.base import BuildEnv

    join(rank, world, port)
    objective = build_objective(ObjectiveConfig(), BuildEnv(languages=("en",), embed_dim=DIM))
    generator = torch.Generator().manual_seed(rank)
    local = batch // world
    audio = torch.nn.functional.normalize(torch.randn(local, DIM, generator=generator), dim=-1).requires_grad_()
    text = torch.nn.functional.normalize(torch.randn(1, local, DIM, generator=generator), dim=-1).requires_grad_()
    embeddings = EmbeddingBatch(
        audio=audio, text=text, text_mask=torch.ones(1, local, dtype=torch.bool), clip_index=torch.arange(local)
    )
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    distributed.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = total_loss(objective(distributed.gather_embedding_batch(embeddings, mode=mode)))  # type: ignore[arg-type]
    loss.backward()
    rss_rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    distributed.barrier()
    if rank == 0:
        Path(out).write_text(f"{sum(saved.values())} {rss_rise * 1024}")
    distributed.destroy_process_group()


def spawn(fn: Any, world: int, *args: Any) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.spawn(fn, args=(world, free_port(), *args, out), nprocs=world, join=True)
        return Path(out).read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="global batch of the speed test")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--memory-batches", default="1024,2048,4096,8192")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"] * 3

    speed = {world: float(spawn(speed_worker, world, args.batch, args.steps)) for world in (1, 2)}
    memory = {}
    for batch in (int(b) for b in args.memory_batches.split(",")):
        for mode in ("global", "local"):
            saved, rss = spawn(memory_worker, 2, batch, mode).split()
            memory[(batch, mode)] = (int(saved), int(rss))
    load_after = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"] * 3

    mib = 2**20
    lines = [
        START,
        "## Distributed training on CPU (`bench/distributed.py`)",
        "",
        f"`python bench/distributed.py` — {cpu_model()}, {os.cpu_count()} cores shared with other work "
        f"(load average {' '.join(load)} before, {' '.join(load_after)} after: noisy), gloo, one thread per "
        f"process, torch {torch.__version__}, {dt.date.today().isoformat()}.",
        "",
        f"Step of the `tiny` model (InfoNCE, 2-s clips) on the same global batch of {args.batch}, "
        f"median of {args.steps} steps:",
        "",
        "| processes | per-process batch | step (ms) | samples/s |",
        "|---:|---:|---:|---:|",
    ]
    for world, seconds in speed.items():
        lines.append(f"| {world} | {args.batch // world} | {1000 * seconds:.0f} | {args.batch / seconds:.1f} |")
    lines += [
        "",
        f"Memory of the InfoNCE loss per process, 2 processes, d = {DIM} (rank 0): saved for backward / "
        "peak-RSS rise over the step.",
        "",
        "| global batch | gather-with-grad (`global`) | local loss (`local`) |",
        "|---:|---:|---:|",
    ]
    batches = sorted({b for b, _ in memory})
    for batch in batches:
        cells = [f"{memory[(batch, m)][0] / mib:.0f} MiB / {memory[(batch, m)][1] / mib:.0f} MiB" for m in ("global", "local")]
        lines.append(f"| {batch} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        "With two processes on two shared cores the second process mostly adds communication and "
        "contention; the point of the table is the method, not a speed-up on this machine. The "
        "`global` loss keeps B² logits (and their softmax) on every rank, `local` B²/N.",
        END,
    ]
    section = "\n".join(lines) + "\n"
    publish_section(section, start=START, end=END, write=not args.no_write)


if __name__ == "__main__":
    main()
