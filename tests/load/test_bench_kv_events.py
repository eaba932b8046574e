"""load/bench_kv_events.py on the tiny GPTQ model: its three servers, its table, and a
subscriber that saw the events."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import REPO


def test_bench_kv_events_compares_on_with_off(tiny_gptq_dir: Path) -> None:
    command = [
        sys.executable, "-m", "load.bench_kv_events", "--model-dir", str(tiny_gptq_dir),
        "--concurrency", "2", "--tokens", "2", "--requests", "4", "--rounds", "2",
        "--max-cache-tokens", "256",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines()
            if line.startswith("| ") and "tokens/s" not in line}  # fmt: skip
    assert set(rows) == {"off", "on, subscribed", "on, no subscriber"}, done.stdout
    assert rows["off"].rstrip().endswith("| 1.000 |")
    seen = done.stdout.split("subscriber: ")[1]
    batches, stored = int(seen.split()[0]), int(seen.split(", ")[1].split()[0])
    assert batches > 0 and stored > 0, done.stdout
    assert "dropped: off 0, on, subscribed 0, on, no subscriber 0" in done.stdout
