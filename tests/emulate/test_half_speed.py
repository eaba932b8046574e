"""emulate.half_speed: one pinned busy loop per core while the command runs, none after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from emulate import half_speed

REPO = Path(__file__).resolve().parents[2]


def loops_of(parent: int) -> list[int]:
    """The busy loops `parent` started (a run of the suite under emulate.half_speed has its own)."""
    pids = []
    for pid in os.listdir("/proc"):
        try:
            if not pid.isdigit() or half_speed.HOG not in Path(f"/proc/{pid}/cmdline").read_text():
                continue
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                pids.append(int(pid))
        except (OSError, IndexError, ValueError):
            pass
    return pids


# run beside the loops: what it sees of its parent's loops, then exit 3
PROBE = """
import json, os
from tests.emulate.test_half_speed import loops_of
pids = loops_of(os.getppid())
print(json.dumps({"cores": [sorted(os.sched_getaffinity(p)) for p in pids],
                  "cgroup": open("/proc/self/cgroup").read()}))
raise SystemExit(3)
"""


def run(*flags: str) -> tuple[int, str, dict[str, Any], int]:
    """Exit code, stderr, what the probe saw and the run's pid; no loop of it is left after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "emulate.half_speed", *flags, "--", sys.executable, "-c", PROBE],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = proc.communicate(timeout=120)
    assert not loops_of(proc.pid)
    return proc.returncode, err, json.loads(out.strip().splitlines()[-1]), proc.pid


def test_the_command_runs_beside_one_loop_per_core_and_its_exit_code_is_returned() -> None:
    code, err, seen, _ = run("--no-cgroups")
    assert code == 3, err
    assert sorted(seen["cores"]) == [[core] for core in half_speed.cores()]  # one each, pinned
    assert seen["cgroup"] == Path("/proc/self/cgroup").read_text()  # this process's groups
    assert "exit 3 after" in err and "(no cgroup)" in err


def test_where_cgroups_can_be_made_the_command_gets_its_own() -> None:
    writable = os.access(half_speed.CGROUP_CPU, os.W_OK)
    code, err, seen, pid = run()
    assert code == 3, err
    assert sorted(seen["cores"]) == [[core] for core in half_speed.cores()]
    # (a run of the suite under emulate.half_speed is in a group of its own run)
    assert (f"half_speed-{pid}-command" in seen["cgroup"]) == writable, seen["cgroup"]
    assert ("cgroups of equal weight" in err) == writable
    assert not list(half_speed.CGROUP_CPU.glob(f"half_speed-{pid}-*"))  # removed after


def test_a_command_is_required() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "emulate.half_speed"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2 and "a command is needed" in done.stderr
