"""How many CPUs this process can use: its affinity, capped by its cgroup's CPU quota.

A container limited to 2 CPUs on a 64-core node still sees 64 cores in ``os.cpu_count()``
and in its affinity mask; the limit lives in the cgroup (v2 ``cpu.max``: ``"200000 100000"``
= quota and period in µs, ``"max 100000"`` = no limit; v1 ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``, quota -1 = no limit). Sizing thread pools from the node's cores
there would run 32× the threads the quota lets run at once.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> int | None:
    """CPUs the cgroup quota allows (quota ÷ period, rounded up), or None when unlimited/unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return max(1, math.ceil(quota_us / period_us)) if quota_us > 0 and period_us > 0 else None


def available_cores(cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on (affinity-aware), capped by its cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root)
    return min(cores, limit) if limit else cores
