"""The CPUs this process may use: what `--threads` defaults from (a leaf: no predictor imports).

A container's CPU limit is a quota of CPU time per period in its cgroup, not a set of cores: a
pod limited to 2 CPUs on a 64-core node sees 64 cores in `sched_getaffinity` and `os.cpu_count`,
and 64 compute threads there would each be throttled most of every period. So the count is the
smaller of the affinity and the quota / period, rounded down (a quota of 1.5 CPUs keeps 1 thread
busy without throttling; 2 would be stopped for a third of every period), and at least 1.

Where the quota is read: cgroup v2's `cpu.max` ("QUOTA PERIOD" or "max PERIOD") in this
process's own cgroup (from `/proc/self/cgroup`) and in each of its parents up to the root (a
limit set on a parent holds for its children too; the smallest counts), else cgroup v1's
`cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: no limit) under `cpu/` or `cpu,cpuacct/`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path, PurePosixPath

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
V1_FOLDERS = ("cpu", "cpu,cpuacct")


def container_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """min(affinity, cgroup quota / period) rounded down, at least 1."""
    cpus = affinity_cpus()
    quota = cgroup_quota(root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, int(quota))
    return max(1, cpus)


def affinity_cpus() -> int:
    """The CPUs the scheduler may run this process on (taskset, a cpuset cgroup)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota in CPUs (1.5: a limit of 1500m), or None where there is none."""
    quotas = [q for folder in v2_folders(root, proc_cgroup) if (q := v2_quota(folder)) is not None]
    if quotas:
        return min(quotas)
    for name in V1_FOLDERS:
        quota = v1_quota(root / name)
        if quota is not None:
            return quota
    return None


def v2_folders(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's cgroup v2 folder and its parents up to `root` (just `root` when
    /proc/self/cgroup names none: inside a container's namespace the root is its own)."""
    own = PurePosixPath("/")
    with contextlib.suppress(OSError):
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                own = PurePosixPath(line[3:].strip() or "/")
    folders = [root / own.relative_to("/")]
    folders += [root / parent.relative_to("/") for parent in own.parents]
    return folders


def v2_quota(folder: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError, ZeroDivisionError):
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
    return None


def v1_quota(folder: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError, ZeroDivisionError):
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        if quota > 0:
            return quota / int((folder / "cpu.cfs_period_us").read_text())
    return None
