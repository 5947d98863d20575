"""`tonearm train CONFIG --plan`: what a run from ``data.shards`` will do on a cluster, without training.

Given the cluster's shape (nodes, GPUs = ranks per node, cores and memory per node, shared
memory per node), prints the epoch plan the loader will use (:mod:`training.data.epoch_plan`:
steps per epoch, coverage), the loader workers per rank and the shuffle buffer each gets, and
the host and shared memory the loader takes per node; refuses (exit 2) a plan that does not fit
the node. The figures are the loader's own formulas, not a simulation:

* index (per rank): ``records.jsonl`` held as Python objects, :data:`RECORDS_RSS_FACTOR` × its
  bytes (measured: a 124 MB records.jsonl of 40 k clips × 8 languages × 5 captions grew a
  process by 297 MB, at its peak too: it is read line by line), plus the epoch's sequence in each worker (16 bytes per usable clip);
* shuffle buffers: workers × entries × crop bytes (float32 crops);
* batches in flight, in shared memory: ``prefetch_factor`` × workers × batch × crop bytes.

The model, optimizer, knowledge bases and CUDA context are not counted (see docs/training.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

from index.errors import DataError
from training.config import ConfigError, TrainConfig
from training.data.epoch_plan import Layout, coverage
from training.data.loader import shuffle_entries

RECORDS_RSS_FACTOR = 2.4
"""Resident bytes per byte of records.jsonl once read into ClipRecords (measured, module doc)."""
SEQUENCE_BYTES = 16
"""Bytes per usable clip of the epoch's sequence in each worker (two int64)."""
HOST_HEADROOM = 0.8
"""Share of a node's memory the loader may plan for (the rest: model, optimizer, CUDA, the OS)."""

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """``512Gi``, ``480G``, ``64gib``, ``1e9`` → bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not match:
        raise ConfigError(f"not a size: {text!r} (e.g. 512Gi, 480G)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    cores_per_node: int
    memory_per_node: int
    shm_per_node: int


@dataclass(frozen=True)
class ClusterPlan:
    lines: list[str]
    fits: bool
    layout: Layout
    steps: int
    coverage: float
    host_bytes: int
    shm_bytes: int


def _gb(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def plan_for(cfg: TrainConfig, cluster: Cluster) -> ClusterPlan:
    """The plan of ``cfg`` on ``cluster`` (module doc)."""
    from training.data.stream import TRAIN_SPLIT, cached_corpus, read_text
    from training.evaluate import clip_samples

    if cfg.data.shards is None:
        raise ConfigError("--plan describes a run from data.shards (data.shards=URL); a manifest run has no shard plan")
    corpus = cached_corpus(cfg)
    usable = len(corpus.records.get(TRAIN_SPLIT, []))
    clips = sum(count for _, count in corpus.shards(TRAIN_SPLIT))
    ranks = cluster.gpus_per_node
    world = cluster.nodes * ranks
    workers = (max(1, cluster.cores_per_node // ranks - 1) if cfg.data.num_workers == "auto"
               else int(cfg.data.num_workers))
    crop = clip_samples(cfg.data, cfg.frontend) * 4
    budget = cfg.data.shuffle_buffer_bytes
    if cfg.data.shuffle_buffer == "auto" and budget is None:
        budget = int(cluster.memory_per_node * 0.2) // (max(1, workers) * ranks)
    entries, buffer_bytes = shuffle_entries(cfg.data.shuffle_buffer, budget, entry_bytes=crop, workers=workers,
                                            ranks_on_node=ranks)
    layout = Layout(world=world, workers=workers, batch_size=cfg.optim.batch_size, buffer=entries)
    cover = coverage(usable, clips, layout)
    records_bytes = len(read_text(f"{corpus.url.rstrip('/')}/records.jsonl").encode("utf-8"))
    index = int(RECORDS_RSS_FACTOR * records_bytes) + SEQUENCE_BYTES * usable * max(1, workers)
    buffers = buffer_bytes * max(1, workers)
    prefetch = cfg.data.prefetch_factor * max(1, workers) * cfg.optim.batch_size * crop if workers else 0
    host = ranks * (index + buffers + prefetch)
    shm = ranks * prefetch
    fits_host = host <= HOST_HEADROOM * cluster.memory_per_node
    fits_shm = shm <= cluster.shm_per_node
    lines = [
        f"cluster: {cluster.nodes} node(s) × {ranks} GPU(s) = world size {world}; {cluster.cores_per_node} cores, "
        f"{_gb(cluster.memory_per_node)} memory, {_gb(cluster.shm_per_node)} /dev/shm per node",
        cover.line(layout),
        f"steps per epoch: {cover.steps}; {cfg.optim.epochs} epoch(s): {cover.steps * cfg.optim.epochs} steps "
        f"(global batch {world * cfg.optim.batch_size})",
        f"coverage: {100 * cover.fraction:.2f} % of the usable clips an epoch ({cover.left_out} left out by the cut)",
        f"loader workers per rank: {workers} (data.num_workers={cfg.data.num_workers})",
        f"shuffle buffer per worker: {entries} crops of {crop / 1e6:.2f} MB = {_gb(buffer_bytes)} "
        f"(data.shuffle_buffer={cfg.data.shuffle_buffer})",
        f"host memory per node for data: {_gb(host)} = {ranks} rank(s) × (index {_gb(index)} + shuffle buffers "
        f"{_gb(buffers)} + batches in flight {_gb(prefetch)}); budget {_gb(HOST_HEADROOM * cluster.memory_per_node)} "
        f"({100 * HOST_HEADROOM:.0f} % of the node) — {'fits' if fits_host else 'DOES NOT FIT'}",
        f"shared memory per node: {_gb(shm)} of {_gb(cluster.shm_per_node)} (batches in flight: prefetch_factor "
        f"{cfg.data.prefetch_factor} × {workers} workers × batch {cfg.optim.batch_size}) — "
        f"{'fits' if fits_shm else 'DOES NOT FIT'}",
        "not counted: model, optimizer, CUDA context, knowledge bases (docs/objectives.md)",
    ]
    return ClusterPlan(lines=lines, fits=fits_host and fits_shm and cover.steps > 0, layout=layout, steps=cover.steps,
                       coverage=cover.fraction, host_bytes=host, shm_bytes=shm)


def cli_plan(args: argparse.Namespace, cfg: TrainConfig) -> int:
    """``tonearm train CONFIG --plan ...``: print the plan; exit 2 (a one-line error) when it does not fit."""
    memory = parse_bytes(args.memory_per_node)
    cluster = Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, cores_per_node=args.cores_per_node,
                      memory_per_node=memory,
                      shm_per_node=parse_bytes(args.shm_per_node) if args.shm_per_node else memory // 2)
    for name in ("nodes", "gpus_per_node", "cores_per_node"):
        if getattr(cluster, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    plan = plan_for(cfg, cluster)
    sys.stdout.write("\n".join(plan.lines) + "\n")
    if not plan.fits:
        raise DataError("the plan does not fit the node (see above): lower data.num_workers, data.prefetch_factor, "
                        "data.shuffle_buffer or optim.batch_size, or give the nodes more memory / /dev/shm")
    return 0
