"""load/bench_sleep.py on the tiny GPTQ model: one round of sleep and wake, and its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import REPO


def test_bench_sleep_measures_a_sleep_and_a_wake(tiny_gptq_dir: Path) -> None:
    command = [sys.executable, "-m", "load.bench_sleep", "--model-dir", str(tiny_gptq_dir),
               "--rounds", "1", "--fill", "1", "--words", "10"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    row = [line for line in done.stdout.splitlines() if line.startswith("| ") and "MiB" in line]
    assert len(row) == 1, done.stdout
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    awake, asleep = (float(c.removesuffix(" MiB")) for c in cells[:2])
    wake = float(cells[3].removesuffix(" s"))
    assert asleep < awake and wake > 0, done.stdout
