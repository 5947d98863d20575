"""What a training process imports before its first step, for a forkserver to load once.

A fresh training process spends seconds before its first step (2026-11-27, AMD EPYC, 2 cores):
~3 s importing torch and the training loop, ~3 s importing ``torch._dynamo`` (``torch.optim``'s
constructor imports it on first use) and ~1.5 s importing matplotlib for the curves. Programs that
start many short training processes — `tonearm bench quality`'s jobs, the test suite's gloo ranks —
fork them from a forkserver that imported this module once::

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["training.warm_imports"])

Nothing here changes the environment or the thread settings: a forked process sets its own.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401

import training.loop  # noqa: E402,F401
import training.plots  # noqa: E402,F401

PRELOAD = ["training.warm_imports"]
"""The forkserver preload list that names this module."""
