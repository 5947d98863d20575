"""`tonearm train CONFIG --plan`: what a run from ``data.shards`` will do on a cluster, without training.

Given the cluster's shape (nodes, GPUs = ranks per node, cores and memory per node, shared
memory per node), prints the epoch plan the loader will use (:mod:`training.data.epoch_plan`:
steps per epoch, coverage), the loader workers per rank and the shuffle buffer each gets, and
the host and shared memory the loader takes per node; refuses (exit 2) a plan that does not fit
the node. The figures are the loader's own formulas, not a simulation:

* index (per rank): what the run keeps of ``records.jsonl`` — every split's columns (ids, seconds,
  shard, ordinal, line offsets, sample offset and size: ~63 bytes a clip, no captions), the stream's
  plan (32 bytes per usable clip) and the epoch's sequence in each worker (16 bytes per usable clip),
  the validation split with its captions
  (:func:`training.memory_plan.count_records`; measured beside it by bench/records_memory.py);
* shuffle buffers: workers × entries × crop bytes (float32 crops; a worker never holds more entries
  than its share of the epoch, so a small corpus caps them);
* batches in flight, in shared memory: ``prefetch_factor`` × workers × batch × crop bytes;
* the processes themselves (measured PSS, bench/plan_pss.py): the training process and each loader
  worker (``Cluster.processes``, a :class:`training.memory_plan.ProcessBaseline`: the default, measured
  on one machine, or a calibration of the machine the run runs on, ``python -m
  training.memory_calibration``) — twice the workers, as validation starts its own beside the
  persistent training workers.

Then, per rank, what the run holds besides its data (:mod:`training.memory_plan`: the model built
on the ``meta`` device from the config, its gradients and AdamW moments, distillation teachers and
their host caches, ASK's knowledge bases between rebuilds and at a rebuild's peak), as a table of
GPU and host figures; rank 0's GPU (the fullest) is set against ``--gpu-memory`` and the node's
host figures against its memory. Activations, the CUDA context and torch's own resident memory
are not counted (see docs/training.md).

The dry run that prints the plan and, with ``--emit-k8s``, the Job rendered from it
(:mod:`training.k8s_job`) is :func:`training.launch.cli_plan`, above this module; the check a run
makes of its own node at start, with the same units, is below it (:mod:`training.data.node_fit`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from training.config import ConfigError, TrainConfig
from training.data.epoch_plan import Layout, coverage
from training.data.loader import shuffle_entries
from training.data.node_fit import _gb
from training.memory_plan import ProcessBaseline

HOST_HEADROOM = 0.8
"""Share of a node's memory the plan may fill (the rest: torch and CUDA libraries, the OS)."""
GPU_HEADROOM = 0.9
"""Share of a GPU's memory the counted figures may fill (the rest: CUDA context, allocator slack)."""

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
    gpu_memory: int = 80 * 2**30
    processes: ProcessBaseline = ProcessBaseline()
    """What a training process and a loader worker take of their own on these nodes (module doc)."""


@dataclass(frozen=True)
class ClusterPlan:
    lines: list[str]
    fits: bool
    layout: Layout
    steps: int
    coverage: float
    host_bytes: int
    """Per node, the loader's (index, shuffle buffers, batches in flight)."""
    shm_bytes: int
    gpu_bytes: int = 0
    """Rank 0's GPU: model, gradients, AdamW, teachers, ASK's KBs at their rebuild peak."""
    node_host_bytes: int = 0
    """Per node, everything counted on the host (the loader's, teacher caches, ASK's rebuild copies)."""
    parameters: int = 0
    trainable: int = 0
    kb_gpu_bytes: int = 0
    kb_rebuild_bytes: int = 0
    advice: tuple[str, ...] = ()


def _knowledge_from_train(cfg: TrainConfig) -> bool:
    """Whether ASK's knowledge-base passes stream the train shards (and read their captions again)."""
    from training.objectives.ask import TRAIN_SOURCE, parse_knowledge_config

    spec = cfg.objective.knowledge
    return bool(spec) and TRAIN_SOURCE in parse_knowledge_config(spec or {}).sources


def _size(value: float) -> str:
    """GiB, or MiB under one GiB (the per-rank figures of small runs)."""
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def plan_for(cfg: TrainConfig, cluster: Cluster) -> ClusterPlan:
    """The plan of ``cfg`` on ``cluster`` (module doc)."""
    from training.data.stream import TRAIN_SPLIT, cached_corpus
    from training.evaluate import clip_samples
    from training.memory_plan import (
        count_knowledge,
        count_model,
        count_records,
        teacher_parameters,
    )

    if cfg.data.shards is None:
        raise ConfigError("--plan describes a run from data.shards (data.shards=URL); a manifest run has no shard plan")
    corpus = cached_corpus(cfg)
    train = corpus.records.get(TRAIN_SPLIT)
    usable = len(train) if train is not None else 0
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
    layout = Layout(world=world, workers=workers, batch_size=cfg.optim.batch_size, buffer=entries,
                    reserve=cfg.data.bad_sample_reserve)
    cover = coverage(usable, clips, layout)
    held = min(entries, -(-(cover.served // max(1, world)) // max(1, workers)))  # a worker's share caps it
    buffer_bytes = held * crop
    records = count_records(corpus, eval_split=cfg.eval.split, workers=workers, world=world,
                            knowledge_pass=_knowledge_from_train(cfg))
    index = records.resident
    buffers = buffer_bytes * max(1, workers)
    prefetch = cfg.data.prefetch_factor * max(1, workers) * cfg.optim.batch_size * crop if workers else 0
    processes = cluster.processes.processes(workers)  # validation's workers beside the training ones
    host = ranks * (index + buffers + prefetch + processes)
    shm = ranks * prefetch
    fits_host = host <= HOST_HEADROOM * cluster.memory_per_node
    fits_shm = shm <= cluster.shm_per_node

    # What the run holds besides its data (training/memory_plan.py).
    model = count_model(cfg)
    state = model.gpu_bytes(world=world)
    teachers = teacher_parameters(cfg) * 4
    distill = cfg.objective.distill or {}
    caches = int(2 * float(distill.get("cache_max_mib", 2048.0)) * 2**20) if distill else 0
    pairs = train.pairs if train is not None else 0
    kb = count_knowledge(cfg, embed_dim=model.embed_dim, train_pairs=pairs, train_clips=usable, world=world)
    kb_gpu = kb.gpu_resident() if kb else 0
    kb_rebuild = kb.gpu_rebuild(rank0=True) if kb else 0
    kb_host = kb.host_rebuild(rank0=False) + records.pass_share if kb else 0
    kb_host0 = kb.host_rebuild(rank0=True) - kb.host_rebuild(rank0=False) if kb else 0
    fixed_gpu = sum(state.values()) + teachers
    gpu = fixed_gpu + max(kb_gpu, kb_rebuild)  # rank 0, the fullest: a rebuild replaces the resident KBs
    gpu_budget = GPU_HEADROOM * cluster.gpu_memory
    fits_gpu = gpu <= gpu_budget
    rank_host = index + buffers + prefetch + processes + caches + kb_host
    node_host = ranks * rank_host + kb_host0
    fits_all_host = node_host <= HOST_HEADROOM * cluster.memory_per_node

    def cell(value: int | None) -> str:
        return "" if value is None else _size(value)

    def count(value: int) -> str:
        return f"{value / 1e6:.1f} M" if value >= 10**5 else f"{value:,}"

    share = f", 1/{kb.share} of the fine rows" if kb and kb.share > 1 else ", whole on every rank" if kb else ""
    rows: list[tuple[str, int | None, int | None]] = [
        (f"parameters: {count(model.parameters)}, fp32", state["parameters"], None),
        (f"gradients: {count(model.trainable)} trainable, fp32" + (" + DDP buckets" if world > 1 else ""),
         state["gradients"], None),
        ("AdamW moments: 2 × fp32 per trainable parameter", state["adamw"], None),
    ]
    if teachers:
        rows.append(("distillation teachers: frozen, fp32", teachers, None))
    if caches:
        rows.append(("teacher caches: 2 × objective.distill.cache_max_mib", None, caches))
    if kb:
        rows += [(f"ASK KBs between rebuilds: {kb.pairs:,} pairs, {kb.clips:,} clips, d {kb.dim}{share}", kb_gpu, None),
                 ("ASK KB rebuild peak (replaces the line above; rank 0)", kb_rebuild, kb_host + kb_host0)]
    rows += [
        ("records.jsonl columns + epoch sequences + validation split", None, index),
        (f"shuffle buffers: {max(1, workers)} worker(s)", None, buffers),
        ("batches in flight (/dev/shm)", None, prefetch),
        (f"processes: training + 2 × {workers} loader worker(s) (training, validation)", None, processes),
        ("total per rank (rank 0)", gpu, rank_host + kb_host0),
    ]
    width = max(len(name) for name, _, _ in rows)
    table = [f"  {'memory per rank':<{width}}  {'GPU':>10}  {'host':>10}"]
    table += [f"  {name:<{width}}  {cell(g):>10}  {cell(h):>10}" for name, g, h in rows]
    lines = [
        f"cluster: {cluster.nodes} node(s) × {ranks} GPU(s) = world size {world}; {cluster.cores_per_node} cores, "
        f"{_gb(cluster.memory_per_node)} memory, {_gb(cluster.shm_per_node)} /dev/shm per node, "
        f"{_gb(cluster.gpu_memory)} per GPU",
        cover.line(layout),
        f"steps per epoch: {cover.steps}; {cfg.optim.epochs} epoch(s): {cover.steps * cfg.optim.epochs} steps "
        f"(global batch {world * cfg.optim.batch_size})",
        f"coverage: {100 * cover.fraction:.2f} % of the usable clips an epoch ({cover.left_out} left out by the cut)",
        f"loader workers per rank: {workers} (data.num_workers={cfg.data.num_workers})",
        f"shuffle buffer per worker: {entries} crops of {crop / 1e6:.2f} MB, {held} of them held (a worker's share "
        f"of an epoch caps it) = {_gb(buffer_bytes)} (data.shuffle_buffer={cfg.data.shuffle_buffer})",
        f"host memory per node for data: {_gb(host)} = {ranks} rank(s) × (index {_gb(index)} + shuffle buffers "
        f"{_gb(buffers)} + batches in flight {_gb(prefetch)} + processes {_gb(processes)}); budget {_gb(HOST_HEADROOM * cluster.memory_per_node)} "
        f"({100 * HOST_HEADROOM:.0f} % of the node) — {'fits' if fits_host else 'DOES NOT FIT'}",
        f"shared memory per node: {_gb(shm)} of {_gb(cluster.shm_per_node)} (batches in flight: prefetch_factor "
        f"{cfg.data.prefetch_factor} × {workers} workers × batch {cfg.optim.batch_size}) — "
        f"{'fits' if fits_shm else 'DOES NOT FIT'}",
        *table,
        f"GPU memory per rank: {_size(gpu)} of {_size(gpu_budget)} ({100 * GPU_HEADROOM:.0f} % of --gpu-memory "
        f"{_size(cluster.gpu_memory)}) — {'fits' if fits_gpu else 'DOES NOT FIT'}; left for activations: "
        f"{_size(max(0.0, gpu_budget - fixed_gpu - kb_gpu))} (CLAP-size at batch 256 × 8 captions peaked at 56.8 GiB "
        "in all on an H100, docs/BENCHMARKS.md gpu_real_size)",
        f"host memory per node, all counted: {_size(node_host)} of {_size(HOST_HEADROOM * cluster.memory_per_node)} — "
        f"{'fits' if fits_all_host else 'DOES NOT FIT'}",
        *[f"note: {note}" for note in model.notes],
        f"processes: {_size(cluster.processes.main)} a training process, {_size(cluster.processes.worker)} a loader "
        f"worker ({cluster.processes.source})",
        "not counted: activations, the CUDA context, torch's own resident memory (docs/training.md)",
    ]
    advice = []
    if not fits_gpu and fixed_gpu > gpu_budget:  # the model (and teachers) alone are over
        advice.append("GPU: freeze a tower (optim.audio.freeze / optim.text.freeze)"
                      + (", fewer or smaller objective.distill.teachers" if teachers else "")
                      + " or use GPUs with more memory (--gpu-memory)")
    elif not fits_gpu:  # the knowledge bases make it not fit
        advice.append("GPU: partition the knowledge bases (objective.knowledge.partition=auto) over more ranks, "
                      "fewer caption languages or knowledge sources, or GPUs with more memory (--gpu-memory)")
    if not (fits_host and fits_all_host):
        advice.append("host: lower data.shuffle_buffer / data.shuffle_buffer_bytes, data.num_workers or "
                      "data.prefetch_factor" + (", objective.distill.cache_max_mib" if caches else "")
                      + (", partition the knowledge bases over more ranks" if kb_host else "")
                      + ", or give the nodes more memory")
    if cover.steps == 0:
        advice.append("the epoch has no step: fewer ranks or a smaller optim.batch_size")
    if not fits_shm:
        advice.append("/dev/shm: lower data.prefetch_factor, data.num_workers or optim.batch_size, or give the pods "
                      "a larger /dev/shm (--shm-per-node)")
    return ClusterPlan(lines=lines, fits=fits_host and fits_shm and fits_gpu and fits_all_host and cover.steps > 0,
                       layout=layout, steps=cover.steps, coverage=cover.fraction, host_bytes=host, shm_bytes=shm,
                       gpu_bytes=gpu, node_host_bytes=node_host, parameters=model.parameters,
                       trainable=model.trainable, kb_gpu_bytes=kb_gpu, kb_rebuild_bytes=kb_rebuild,
                       advice=tuple(advice))
