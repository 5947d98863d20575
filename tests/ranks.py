"""Start the gloo ranks of a distributed test as forks of a warm forkserver (not fresh interpreters).

``torch.multiprocessing.spawn`` starts each rank as a new Python process, which spends ~6-8 s of CPU
importing torch, ``torch._dynamo`` and the training loop before its first collective
(training/warm_imports.py); the suite starts ~30 such ranks. Here the ranks are forked from a
forkserver that imported those modules once per test session. Each rank then takes the parent's
environment and working directory as they are at the call — what a spawned process would
have seen, rather than the forkserver's from when it started.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

from training.warm_imports import PRELOAD


def spawn_ranks(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 2) -> None:
    """``mp.spawn(fn, args, nprocs, join=True)``, with ranks forked from the warm forkserver."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when this session's forkserver starts
    mp.start_processes(_as_spawned, args=(fn, dict(os.environ), os.getcwd(), tuple(args)), nprocs=nprocs,
                       join=True, start_method="forkserver")


def _as_spawned(rank: int, fn: Callable[..., Any], env: dict[str, str], cwd: str, args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fn(rank, *args)
