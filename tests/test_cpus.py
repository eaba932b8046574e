"""The CPUs `--threads` defaults from: the affinity capped by a container's CPU quota, read
from fake cgroup trees (v2 and v1) under tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from predictor import cpus
from predictor.cpus import cgroup_quota, container_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="affinity: Linux")


@pytest.fixture
def affinity(monkeypatch: pytest.MonkeyPatch) -> int:
    """A 64-core node: the quota, not the node's cores, must decide."""
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 64)
    return 64


def proc_cgroup(tmp_path: Path, own: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(f"0::{own}\n")
    return path


def cpu_max(folder: Path, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.max").write_text(text + "\n")


def test_no_cgroup_files_leave_the_affinity(tmp_path: Path) -> None:
    none = tmp_path / "missing"
    assert container_cpus(tmp_path, none) == len(os.sched_getaffinity(0))
    assert cgroup_quota(tmp_path, none) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [("max 100000", 64), ("200000 100000", 2), ("150000 100000", 1), ("50000 100000", 1),
     ("400000 50000", 8), ("garbage", 64)],
)  # fmt: skip
def test_v2_quota_rounds_down_at_least_one(
    tmp_path: Path, affinity: int, text: str, expected: int
) -> None:
    """1.5 CPUs: one thread (two would be throttled a third of every period); 0.5: one."""
    cpu_max(tmp_path, text)
    assert container_cpus(tmp_path, tmp_path / "missing") == expected


def test_v2_the_smallest_quota_of_the_own_cgroup_and_its_parents(
    tmp_path: Path, affinity: int
) -> None:
    own = "/kubepods/pod1/ctr"
    proc = proc_cgroup(tmp_path, own)
    root = tmp_path / "cg"
    cpu_max(root, "max 100000")
    cpu_max(root / "kubepods", "max 100000")
    cpu_max(root / "kubepods" / "pod1", "300000 100000")  # the pod's limit: 3 CPUs
    cpu_max(root / "kubepods" / "pod1" / "ctr", "max 100000")
    assert container_cpus(root, proc) == 3
    cpu_max(root / "kubepods" / "pod1" / "ctr", "250000 100000")  # the container's: 2.5
    assert cgroup_quota(root, proc) == 2.5
    assert container_cpus(root, proc) == 2


def test_the_affinity_caps_a_larger_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 2)  # taskset -c 0,1
    cpu_max(tmp_path, "800000 100000")
    assert container_cpus(tmp_path, tmp_path / "missing") == 2


@pytest.mark.parametrize("folder", ["cpu", "cpu,cpuacct"])
def test_v1_cfs_quota(tmp_path: Path, affinity: int, folder: str) -> None:
    v1 = tmp_path / folder
    v1.mkdir()
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # no limit
    assert container_cpus(tmp_path, tmp_path / "missing") == 64
    (v1 / "cpu.cfs_quota_us").write_text("450000\n")
    assert container_cpus(tmp_path, tmp_path / "missing") == 4
    (v1 / "cpu.cfs_quota_us").write_text("20000\n")
    assert container_cpus(tmp_path, tmp_path / "missing") == 1


def test_v2_wins_over_v1(tmp_path: Path, affinity: int) -> None:
    cpu_max(tmp_path, "300000 100000")
    v1 = tmp_path / "cpu"
    v1.mkdir(exist_ok=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert container_cpus(tmp_path, tmp_path / "missing") == 3
