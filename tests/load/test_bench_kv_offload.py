"""load/bench_kv_offload.py on the tiny GPTQ model: a cold server, its restart over the same
folder, the same text, and the restart's prompt found on disk."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support import REPO


def test_bench_kv_offload_restarts_onto_its_disk_cache(tiny_gptq_dir: Path) -> None:
    command = [sys.executable, "-m", "load.bench_kv_offload", "--model-dir", str(tiny_gptq_dir),
               "--words", "120", "--rounds", "1"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    found = re.search(r"round 1: (\d+) prompt tokens, .* \((\S+)x\), (\d+) cached", done.stdout)
    assert found, done.stdout
    prompt, cached = int(found[1]), int(found[3])
    assert cached == (prompt - 1) // 16 * 16 > 0, done.stdout
    assert "median: first token" in done.stdout
