"""``tonearm train --nproc-per-node N CONFIG``: start N training processes on this node via torchrun.

For people who do not know torchrun: the command re-runs itself as
``python -m torch.distributed.run --standalone --nproc-per-node N -m tonearm train CONFIG …``
(one node, a private rendezvous on a free port). Inside a torchrun worker
(``WORLD_SIZE`` set) or with N = 1 it trains in this process. Several nodes need torchrun
itself with a rendezvous endpoint (docs/training.md, "Distributed").

**Deterministic failures under a supervisor** (docs/deploy.md, "Failure policy"): a ``DataError``,
a ``ConfigError`` or a refused plan is recorded for the supervisor (:mod:`training.fatal`), and a
process started after one fails at once.

The dry run ``tonearm train CONFIG --plan … [--emit-k8s]`` (:func:`cli_plan`) is dispatched here too:
the plan of :mod:`training.data.cluster_plan`, and the Job :mod:`training.k8s_job` renders from it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from index.errors import DataError, TonearmError
from training.config import ConfigError, TrainConfig, load_train_config
from training.data.cluster_plan import Cluster, parse_bytes, plan_for
from training.fatal import record_fatal, refuse_after_fatal
from training.k8s_job import emit, pod_cluster
from training.memory_plan import read_process_baseline
from training.rundir import refuse_unless_chosen, train_command, train_overrides


def worker_argv(argv: list[str]) -> list[str]:
    """The command line of each worker: this one without ``--nproc-per-node N``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def torchrun_command(argv: list[str], processes: int) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m tonearm …`` for `argv`."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
        "-m", "tonearm", *worker_argv(argv),
    ]


def check_before_launch(cfg: TrainConfig, processes: int) -> None:
    """Errors every worker would hit, reported once here instead of N times through torchrun."""
    from training.distributed import check_clips_per_rank
    from training.loop import load_training_data

    train_records, _ = load_training_data(cfg)
    check_clips_per_rank(len(train_records), processes)


def cli_train(args: argparse.Namespace) -> int:
    """Entry point of `tonearm train`: torchrun for ``--nproc-per-node N > 1``, else train here."""
    if getattr(args, "plan", False) or getattr(args, "emit_k8s", False):  # a dry run: the plan, no training
        return cli_plan(args, load_train_config(args.config, train_overrides(args)))
    refuse_after_fatal()
    try:
        return _train(args)
    except TonearmError as err:  # DataError, ConfigError, a refused plan: deterministic (module doc)
        record_fatal(err)
        raise


def cli_plan(args: argparse.Namespace, cfg: TrainConfig) -> int:
    """``tonearm train CONFIG --plan ...``: print the plan; exit 2 (a one-line error) when it does not fit."""
    memory = parse_bytes(args.memory_per_node)
    cluster = Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, cores_per_node=args.cores_per_node,
                      memory_per_node=memory,
                      shm_per_node=parse_bytes(args.shm_per_node) if args.shm_per_node else memory // 2,
                      gpu_memory=parse_bytes(getattr(args, "gpu_memory", None) or "80Gi"),
                      processes=read_process_baseline(getattr(args, "process_baseline", None)))
    for name in ("nodes", "gpus_per_node", "cores_per_node"):
        if getattr(cluster, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    emit_k8s = getattr(args, "emit_k8s", False)
    out = sys.stderr if emit_k8s else sys.stdout
    allocatable = getattr(args, "allocatable_per_node", None)
    if emit_k8s or allocatable:  # a pod gets the node's allocatable, not its capacity (training/k8s_job.py)
        cluster, line = pod_cluster(cluster, allocatable)
        out.write(line + "\n")
    plan = plan_for(cfg, cluster)
    out.write("\n".join(plan.lines) + "\n")
    if plan.fits and emit_k8s:  # the Job of k8s/train-multinode sized by this plan (training/k8s_job.py)
        sys.stdout.write(emit(args, cfg, plan, cluster))
    if not plan.fits:
        raise DataError("the plan does not fit the node (see above): "
                        + "; ".join(plan.advice))
    return 0


def _train(args: argparse.Namespace) -> int:
    processes = getattr(args, "nproc_per_node", None)
    if processes is not None and processes < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, got {processes}")
    if processes is None or processes == 1 or "WORLD_SIZE" in os.environ:
        from training.loop import cli_train as train_here

        return train_here(args)
    # One clear refusal here rather than one per worker process.
    cfg = load_train_config(args.config, train_overrides(args))
    refuse_unless_chosen(cfg, command=train_command(args))
    check_before_launch(cfg, processes)
    # OMP threads: torchrun sets 1 per worker unless told; keep the user's setting if any.
    return subprocess.call(torchrun_command(args.argv, processes))
