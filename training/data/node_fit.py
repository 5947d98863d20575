"""The node check a run from ``data.shards`` makes at start: does this node hold what the plan counts?

:func:`refuse_unless_node_fits` sets the per-node figures of ``tonearm train CONFIG --plan``
(:mod:`training.data.cluster_plan`) for the run's own layout — batches in flight in /dev/shm, and
per rank the corpus index, shuffle buffers, batches in flight and processes
(:class:`training.memory_plan.ProcessBaseline`: the default, or a calibration file named by
``$TONEARM_PROCESS_BASELINE``) — against
the node's /dev/shm (:func:`shm_size`) and memory, and refuses with a :class:`ConfigError` naming the
settings, before any step rather than as a dead loader worker mid-run. The stream calls it
(:func:`training.data.stream.build_stream_loader`); the plan sits above it and shares its units.
"""

from __future__ import annotations

import os

from training.config import ConfigError, TrainConfig
from training.memory_plan import read_process_baseline


def _gb(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def shm_size(path: str = "/dev/shm") -> int | None:
    """Bytes of the shared-memory file system (None where there is none)."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_blocks * stats.f_frsize


def refuse_unless_node_fits(cfg: TrainConfig, *, workers: int, buffer_bytes: int, crop: int, index: int,
                            ranks_on_node: int, shm: int | None, memory: int) -> None:
    """At the start of a real run: the plan's per-node figures for this run's own layout set against the
    node's /dev/shm and memory (its cgroup limit where set); a :class:`ConfigError` naming the settings
    when they do not fit — before any step, not as a dead loader worker mid-run."""
    prefetch = cfg.data.prefetch_factor * workers * cfg.optim.batch_size * crop if workers else 0
    need_shm = ranks_on_node * prefetch
    if shm is not None and workers and need_shm > shm:
        raise ConfigError(
            f"/dev/shm holds {_gb(shm)}, and {ranks_on_node} rank(s) on this node put {_gb(need_shm)} of batches in "
            f"flight there (data.prefetch_factor={cfg.data.prefetch_factor} × data.num_workers={workers} × "
            f"optim.batch_size={cfg.optim.batch_size} × {crop / 1e6:.2f} MB crops per rank): lower one of them or "
            "mount a larger /dev/shm (Kubernetes: the shm volume's sizeLimit; `tonearm train CONFIG --plan … "
            "--emit-k8s` sizes it)")
    processes = read_process_baseline().processes(workers)
    rank = index + buffer_bytes * max(1, workers) + prefetch + processes
    if ranks_on_node * rank > memory:
        raise ConfigError(
            f"this node gives the job {_gb(memory)} of memory and {ranks_on_node} rank(s) need {_gb(ranks_on_node * rank)} "
            f"by the plan's count (per rank: corpus index {_gb(index)}, shuffle buffers {_gb(buffer_bytes * max(1, workers))} "
            f"— data.shuffle_buffer={cfg.data.shuffle_buffer} —, batches in flight {_gb(prefetch)}, processes "
            f"{_gb(processes)} — data.num_workers={workers}): lower "
            "data.shuffle_buffer / data.shuffle_buffer_bytes, data.num_workers or data.prefetch_factor, or give "
            "the pod more memory (`tonearm train CONFIG --plan … --emit-k8s` sizes it)")
