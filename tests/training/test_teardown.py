"""A run that ends: DDP's Reducer is freed before the gloo group is destroyed (issue 48, pytorch#56297).

The stress (tests/training/teardown_stress.py) repeats the end of a DDP run in 2 forked gloo ranks with
async collectives in flight and a busy-loop process beside them. In the old order (barrier, destroy, then
the model freed) a rank deadlocks within a few iterations; with :func:`training.distributed.release_and_leave`
— what ``train()`` calls on every path — every iteration ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def stress(order: str, iterations: int, timeout_s: float) -> tuple[bool, str]:
    """(ended in time, output) of the stress; a hung run's whole process group is killed."""
    command = [sys.executable, "-m", "tests.training.teardown_stress", "--order", order,
               "--iterations", str(iterations), "--busy", "1", "--inflight", "8"]
    process = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        return False, out
    return process.returncode == 0, out


def test_the_run_is_freed_before_the_group_ends_every_time() -> None:
    ended, out = stress("fixed", 10, timeout_s=90)
    assert ended and "ended 10 iterations" in out, out[-3000:]


@pytest.mark.slow
def test_the_old_order_deadlocks_under_the_same_stress() -> None:
    """What makes the test above able to fail: the order train() had hangs (8 iterations, 20 s)."""
    ended, out = stress("old", 8, timeout_s=20)
    assert not ended, f"the old teardown order ended 8 iterations; the stress no longer reproduces the hang: {out[-2000:]}"
