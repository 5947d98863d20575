"""Usable cores: the affinity mask capped by the cgroup CPU quota (a container's CPU limit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from index.cpus import available_cores, cgroup_cpu_limit


def write(root: Path, name: str, text: str) -> None:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)


@pytest.mark.parametrize(("cpu_max", "expected"), [
    ("200000 100000\n", 2),   # a 2-CPU limit
    ("150000 100000\n", 2),   # 1.5 CPUs: threads for 2 (rounded up)
    ("50000 100000\n", 1),    # half a CPU: still one
    ("max 100000\n", None),   # no limit
])
def test_cgroup_v2_quota(tmp_path: Path, cpu_max: str, expected: int | None) -> None:
    write(tmp_path, "cpu.max", cpu_max)
    assert cgroup_cpu_limit(tmp_path) == expected


@pytest.mark.parametrize(("quota", "expected"), [("400000", 4), ("-1", None)])
def test_cgroup_v1_quota(tmp_path: Path, quota: str, expected: int | None) -> None:
    write(tmp_path, "cpu/cpu.cfs_quota_us", quota + "\n")
    write(tmp_path, "cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path) == expected


def test_no_cgroup_files_or_garbage_mean_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None
    write(tmp_path, "cpu.max", "garbage\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_available_cores_is_the_affinity_capped_by_the_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert available_cores(tmp_path) == affinity  # no quota files: the affinity
    write(tmp_path, "cpu.max", "100000 100000\n")
    assert available_cores(tmp_path) == 1
    write(tmp_path, "cpu.max", f"{(affinity + 8) * 100000} 100000\n")
    assert available_cores(tmp_path) == affinity  # a quota above the affinity does not add cores
