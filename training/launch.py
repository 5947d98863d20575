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

from training.config import ConfigError


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line equivalent to `args` (without ``--nproc-per-node`` for the workers)."""
    worker = ["-m", "tonearm", *(["-v"] if getattr(args, "verbose", False) else []), "train"]
    worker += [args.config] if args.config else []
    worker += list(args.overrides or [])
    worker += [flag for flag, on in (("--overwrite", getattr(args, "overwrite", False)),
               ("--drop-other-languages", getattr(args, "drop_other_languages", False))) if on]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc_per_node),
        *worker,
    ]


def cli_train(args: argparse.Namespace) -> int:
    """Entry point of `tonearm train`: torchrun for ``--nproc-per-node N > 1``, else train here."""
    processes = getattr(args, "nproc_per_node", None)
    if processes is not None and processes < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, got {processes}")
    if processes is None or processes == 1 or "WORLD_SIZE" in os.environ:
        from training.loop import cli_train as train_here

        return train_here(args)
    from training.config import load_train_config
    from training.rundir import refuse_unless_chosen, train_command, train_overrides

    # One clear refusal here rather than one per worker process.
    refuse_unless_chosen(load_train_config(args.config, train_overrides(args)), command=train_command(args))
    # OMP threads: torchrun sets 1 per worker unless told; keep the user's setting if any.
    return subprocess.call(torchrun_command(args))
