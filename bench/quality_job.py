"""What every `tonearm bench quality` job imports, loaded once by the jobs' forkserver.

A job is a short training run (a minute at the real budget, seconds in the smoke) in a process of
its own, so that one job's failure or memory cannot reach the others. Started fresh, each process
paid ~8 s before its first step (2026-11-27, AMD EPYC, 2 cores): ~3 s importing torch and the
training loop, ~3 s importing ``torch._dynamo`` (``torch.optim``'s constructor imports it on first
use) and ~1.5 s importing matplotlib for the curves. The forkserver imports these once, single-
threaded; each job is forked from it (bench/quality.py ``_job_process``).
"""

from __future__ import annotations

import os

# one intra-op thread per job (jobs run side by side, one per core), set before torch is imported
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

import matplotlib  # noqa: E402

matplotlib.use("Agg")

import matplotlib.pyplot  # noqa: E402,F401
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401

import training.loop  # noqa: E402,F401
import training.plots  # noqa: E402,F401


def one_thread() -> None:
    """In a forked job: one torch thread (the forkserver set the environment before importing torch)."""
    torch.set_num_threads(1)
