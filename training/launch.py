"""``tonearm train --nproc-per-node N CONFIG``: start N training processes on this node via torchrun.

For people who do not know torchrun: the command re-runs itself as
``python -m torch.distributed.run --standalone --nproc-per-node N -m tonearm train CONFIG …``
(one node, a private rendezvous on a free port). Inside a torchrun worker
(``WORLD_SIZE`` set) or with N = 1 it trains in this process. Several nodes need torchrun
itself with a rendezvous endpoint (docs/training.md, "Distributed").

**Deterministic failures under a supervisor** (docs/deploy.md, "Failure policy"). A ``DataError``, a
``ConfigError`` or a refused plan fails the same way on every restart, so restarting is waste. With
``TONEARM_FATAL_FILE`` set (the Kubernetes Job sets it to a file on the pod's own ``/tmp``), a
training process that fails with one writes its message there before it exits (status 2, as
always); a process started while the file exists — torchrun restarting its workers after that
failure — fails at once with the same message, so torchrun's ``--max-restarts`` are spent in
seconds; and the Job's script turns torchrun's failure into :data:`FATAL_EXIT` when the file
exists, which the Job's ``podFailurePolicy`` marks ``FailJob``. Any other failure (a lost node,
NCCL, an out-of-memory kill) is transient: torchrun restarts, then the pod fails and the Job
replaces it within ``backoffLimit``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from index.errors import TonearmError
from training.config import ConfigError, TrainConfig

FATAL_EXIT = 42
"""The exit status of a training pod whose run failed deterministically (module doc)."""
FATAL_FILE_ENV = "TONEARM_FATAL_FILE"


class EarlierFatalError(TonearmError):
    """The failure another process of this launch already met (``TONEARM_FATAL_FILE``)."""


def record_fatal(err: BaseException) -> None:
    """Write a deterministic failure's message to ``TONEARM_FATAL_FILE`` (when set; first one wins)."""
    path = os.environ.get(FATAL_FILE_ENV)
    if not path or os.path.exists(path):
        return
    rank = os.environ.get("RANK", "0")
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(f"rank {rank}: {type(err).__name__}: {err}\n")
    os.replace(tmp, path)


def refuse_after_fatal() -> None:
    """Fail at once when another process of this launch already failed deterministically."""
    path = os.environ.get(FATAL_FILE_ENV)
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            first = handle.read().strip()
        raise EarlierFatalError(f"not restarted: this launch already failed deterministically ({first}); "
                                f"fix the cause and start a new one ({FATAL_FILE_ENV}={path})")


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
        from training.config import load_train_config
        from training.data.cluster_plan import cli_plan
        from training.rundir import train_overrides

        return cli_plan(args, load_train_config(args.config, train_overrides(args)))
    refuse_after_fatal()
    try:
        return _train(args)
    except TonearmError as err:  # DataError, ConfigError, a refused plan: deterministic (module doc)
        record_fatal(err)
        raise


def _train(args: argparse.Namespace) -> int:
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
