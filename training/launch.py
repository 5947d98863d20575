"""``tonearm train --nproc-per-node N CONFIG``: start N training processes on this node via torchrun.

For people who do not know torchrun: the command re-runs itself as
``python -m torch.distributed.run --standalone --nproc-per-node N -m tonearm train CONFIG …``
(one node, a private rendezvous on a free port). Inside a torchrun worker
(``WORLD_SIZE`` set) or with N = 1 it trains in this process. Several nodes need torchrun
itself with a rendezvous endpoint (docs/training.md, "Distributed").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from training.config import ConfigError, TrainConfig


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
    if getattr(args, "plan", False):  # a dry run: the data plan on the cluster given, no training
        from training.config import load_train_config
        from training.data.cluster_plan import cli_plan
        from training.rundir import train_overrides

        return cli_plan(args, load_train_config(args.config, train_overrides(args)))
    processes = getattr(args, "nproc_per_node", None)
    if processes is not None and processes < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, got {processes}")
    if processes is None or processes == 1 or "WORLD_SIZE" in os.environ:
        from training.loop import cli_train as train_here

        return train_here(args)
    from training.config import load_train_config
    from training.rundir import refuse_unless_chosen, train_command, train_overrides

    # One clear refusal here rather than one per worker process.
    cfg = load_train_config(args.config, train_overrides(args))
    refuse_unless_chosen(cfg, command=train_command(args))
    check_before_launch(cfg, processes)
    # OMP threads: torchrun sets 1 per worker unless told; keep the user's setting if any.
    return subprocess.call(torchrun_command(args.argv, processes))
