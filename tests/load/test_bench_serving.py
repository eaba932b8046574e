"""load/bench_serving.py in OIP and OpenAI modes against the test server."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO, ServerProcess


@pytest.mark.parametrize("api", ["oip", "openai"])
def test_bench_serving_measures_either_api(server: ServerProcess, api: str) -> None:
    command = [
        sys.executable, "-m", "load.bench_serving", "--url", server.base_url, "--model",
        server.model_name, "--api", api, "--concurrency", "1", "2", "--rounds", "1",
        "--max-tokens", "4",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(float(row[-1]) > 0 for row in rows)  # tokens/s
    expected = "/v1/chat/completions" if api == "openai" else "/generate_stream"
    assert expected in done.stdout


@pytest.mark.parametrize("api", ["oip", "openai"])
def test_shared_prefix_workload_reports_the_hit_rate(server: ServerProcess, api: str) -> None:
    """The document again and again: after the warm-up request nearly all of every prompt is
    served from the prefix cache (the responses' cached-token counts say so)."""
    command = [
        sys.executable, "-m", "load.bench_serving", "--url", server.base_url, "--model",
        server.model_name, "--api", api, "--workload", "shared-prefix", "--concurrency", "1",
        "2", "--requests", "2", "--max-tokens", "2", "--document-chars", "900",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"]
    for row in rows:
        assert row[-1].endswith("%") and int(row[-1][:-1]) >= 80, done.stdout
