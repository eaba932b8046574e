"""load/locustfile.py under headless locust against the test server, and load/run_load.py's
summary and plot on the CSV files it writes."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import REPO, ServerProcess

SECONDS = 6


def start_locust(server: ServerProcess, out: Path, users: int, *classes: str) -> subprocess.Popen:
    """Locust headless for SECONDS against the server, writing its CSV files under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LOAD_MODEL=server.model_name, LOAD_MAX_TOKENS="8", LOAD_CHAT="0",
               LOAD_GRPC_TARGET=server.grpc_target)  # fmt: skip
    command = [
        sys.executable, "-m", "locust", "-f", str(REPO / "load" / "locustfile.py"),
        "--headless", "-u", str(users), "-r", str(users), "-t", f"{SECONDS}s",
        "--host", server.base_url, "--csv", str(out / f"u{users}"), "--only-summary", *classes,
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish_locust(run: subprocess.Popen, out: Path, users: int) -> dict:
    """Its exit code, output and stats rows, once it ends (180 s at most: three locusts start
    at once beside the other tests on two cores)."""
    try:
        output, _ = run.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        run.kill()
        output, _ = run.communicate()
        raise AssertionError(f"locust did not exit within 180 s: {output[-3000:]}") from None
    with (out / f"u{users}_stats.csv").open(newline="") as handle:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(handle)}
    return {"code": run.returncode, "output": output, "rows": rows}


def count(rows: dict, key: tuple[str, str]) -> int:
    assert key in rows, f"no {key} row in {sorted(rows)}"
    return int(rows[key]["Request Count"])


@pytest.fixture(scope="module")
def runs(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The three user mixes at once, against one server (6 users in all), each its own run."""
    base = tmp_path_factory.mktemp("locust")
    mixes = {"stream": ("GenerateStreamUser",), "grpc": ("GrpcStreamUser", "InferUser"),
             "openai": ("OpenAIChatStreamUser",)}  # fmt: skip
    started = {name: start_locust(server, base / name, 2, *classes)
               for name, classes in mixes.items()}  # fmt: skip
    return {name: finish_locust(run, base / name, 2) | {"dir": base / name}
            for name, run in started.items()}  # fmt: skip


def check_clean(run: dict) -> dict:
    assert run["code"] == 0, run["output"][-3000:]
    total = run["rows"][("", "Aggregated")]
    assert int(total["Request Count"]) > 0
    assert int(total["Failure Count"]) == 0, run["output"][-3000:]
    return run["rows"]


def test_generate_stream_users(runs: dict) -> None:
    rows = check_clean(runs["stream"])
    assert count(rows, ("POST", "generate_stream")) > 0
    for metric in ("TTFT", "TPOT", "TOKENS"):
        assert count(rows, (metric, "generate_stream")) > 0
    assert float(rows[("TOKENS", "generate_stream")]["Average Response Time"]) == 8.0
    assert 0 < float(rows[("TTFT", "generate_stream")]["Average Response Time"]) < 10_000


def test_grpc_stream_and_infer_users(runs: dict) -> None:
    rows = check_clean(runs["grpc"])
    assert count(rows, ("gRPC", "grpc_stream")) > 0
    assert count(rows, ("POST", "infer")) > 0
    for metric in ("TTFT", "TPOT", "TOKENS"):
        assert count(rows, (metric, "grpc_stream")) > 0
    assert count(rows, ("TOKENS", "infer")) > 0
    assert float(rows[("TOKENS", "grpc_stream")]["Average Response Time"]) == 8.0


def test_openai_chat_stream_users(runs: dict) -> None:
    rows = check_clean(runs["openai"])
    assert count(rows, ("POST", "openai_chat_stream")) > 0
    for metric in ("TTFT", "TPOT", "TOKENS"):
        assert count(rows, (metric, "openai_chat_stream")) > 0
    assert float(rows[("TOKENS", "openai_chat_stream")]["Average Response Time"]) == 8.0


def load_run_load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_load", REPO / "load" / "run_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("which", ["stream", "grpc"])
def test_summarise_writes_table_csv_and_plot(runs: dict, which: str) -> None:
    out = runs[which]["dir"]
    text = load_run_load().summarise(out, [2], SECONDS)
    assert (out / "load.png").stat().st_size > 1000
    assert (out / "summary.txt").read_text() == text
    assert "TTFT p50 ms" in text and "output tok/s" in text
    with (out / "summary.csv").open(newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["users"] == "2" and int(row["requests"]) > 0 and row["failures"] == "0"
    assert float(row["ttft_p50_ms"]) > 0 and float(row["tpot_p50_ms"]) >= 0
    assert float(row["tokens_per_request"]) == 8.0
    # every TOKENS entry is 8 tokens; the rate is over locust's window (its Requests/s column)
    rates = [float(r["Requests/s"]) for key, r in runs[which]["rows"].items() if key[0] == "TOKENS"]
    assert math.isclose(float(row["output_tokens_per_s"]), 8 * sum(rates), rel_tol=1e-4)


BLOCKED_EXIT = """
import sys, time
sys.path.insert(0, {load!r})
from locustfile import *  # noqa: F403 - its listeners, the exit watchdog among them
from gevent import monkey
from locust import User, constant, events, task


class CountingUser(User):
    wait_time = constant(0.5)

    @task
    def tick(self) -> None:
        self.environment.events.request.fire(request_type="X", name="tick", response_time=1,
                                             response_length=0, exception=None, context={{}})


@events.init.add_listener
def _block_exit(environment, **_):
    @environment.events.quit.add_listener  # after the watchdog's listener
    def _stuck(**_):
        monkey.get_original("time", "sleep")(3600)  # a C-level block, as grpc's can be
"""


def test_a_blocked_exit_ends_after_the_grace_with_the_final_csv(tmp_path: Path) -> None:
    """The locustfile's watchdog ends a process whose exit is stuck after the summary (as a
    tritonclient stream thread under gevent can leave it), and writes the final CSV first."""
    locustfile = tmp_path / "blocked.py"
    locustfile.write_text(BLOCKED_EXIT.format(load=str(REPO / "load")))
    command = [
        sys.executable, "-m", "locust", "-f", str(locustfile), "--headless", "-u", "1", "-r", "1",
        "-t", "2s", "--csv", str(tmp_path / "b"), "--only-summary", "--exit-grace", "1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exit still blocked 1 s after shutdown" in done.stderr
    with (tmp_path / "b_stats.csv").open(newline="") as handle:
        rows = {r["Name"]: r for r in csv.DictReader(handle)}
    assert int(rows["tick"]["Request Count"]) >= 1  # the final stats (a busy CPU: one tick)
