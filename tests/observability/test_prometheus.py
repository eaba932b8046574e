"""A real Prometheus (Debian's package, see test_rules.py) scrapes a real predictor every second,
with the PrometheusRule's rules loaded, while a short load runs; then every query of every
dashboard panel (read from the dashboard's JSON, Grafana's variables filled) and every recording
rule returns data through Prometheus's HTTP API, and every rule, alerts included, evaluates
without an error. A metric renamed or a label changed fails here, not on a dashboard."""

from __future__ import annotations

import math
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.observability.test_rules import (
    panel_queries,
    prometheus_tool,
    recording_rules,
    write_rules,
)
from tests.support import ServerProcess

MODEL = "tiny"
TENANT = "team-a"
PROMPT = "Count the sheep in the field, one by one, and tell me how many there are in all."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = answer.json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def wait_for(self, what: str, ready: Callable[[], bool], seconds: float = 20.0) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not in {seconds:.0f} s; {self.log_tail()}")
            time.sleep(0.2)

    def scrapes_since(self, since: float) -> int:
        """Scrapes of the predictor that began after `since` (the epoch, in seconds)."""
        window_ms = max(1, int((time.time() - since) * 1000))
        found = self.query(f'count_over_time(up{{job="predictor"}}[{window_ms}ms])')
        return int(float(found[0]["value"][1])) if found else 0

    def log_tail(self) -> str:
        return "prometheus log:\n" + "\n".join(self.log.read_text().splitlines()[-20:])


@contextmanager
def prometheus(folder: Path, target: str) -> Iterator[Prometheus]:
    """The real server, on a loopback port, scraping `target` and evaluating the rules each
    second, its storage in `folder`."""
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(write_rules(folder))],
        "scrape_configs": [{
            "job_name": "predictor",
            "static_configs": [{"targets": [target], "labels": {"namespace": "test"}}],
        }],
    }  # fmt: skip
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = folder / "prometheus.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [prometheus_tool("prometheus"), f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    server = Prometheus(f"http://127.0.0.1:{port}", log)
    try:

        def ready() -> bool:
            assert process.poll() is None, server.log_tail()
            try:
                return httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        server.wait_for("Prometheus ready", ready)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def load(server: ServerProcess) -> None:
    """A few completions (one for a tenant, by OpenAI's `user`), a V2 generate, and a request
    the server refuses (max_tokens over the limit: 400, reason invalid_request)."""
    base = server.base_url
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    with httpx.Client(timeout=60) as client:
        client.post(f"{base}/v1/completions", json=completion).raise_for_status()
        client.post(
            f"{base}/v1/completions", json={**completion, "user": TENANT}
        ).raise_for_status()
        client.post(f"{base}/v1/chat/completions", json={**chat, "user": TENANT}).raise_for_status()
        generate = {"text_input": PROMPT, "parameters": {"max_tokens": 8}}
        client.post(f"{base}/v2/models/{MODEL}/generate", json=generate).raise_for_status()
        refused = client.post(f"{base}/v1/completions", json={**completion, "max_tokens": 99999})
        assert refused.status_code == 400


def has_a_number(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(sample["value"][1])) for sample in result)


def test_every_panel_and_recording_rule_returns_data(tiny_gptq_dir: Path, tmp_path: Path) -> None:
    with (
        ServerProcess.start(tiny_gptq_dir, MODEL) as server,
        prometheus(tmp_path, f"127.0.0.1:{server.http_port}") as prom,
    ):
        prom.wait_for(
            "a scrape of the predictor", lambda: prom.query('up{job="predictor"} == 1') != []
        )
        # two rounds, a scrape between them and two after: every counter (the tenant's and the
        # error's, created by the first round) rises between two samples of each rate window
        for _ in range(2):
            load(server)
            done = time.time()
            prom.wait_for(
                "two scrapes after the load", lambda done=done: prom.scrapes_since(done) >= 2
            )

        queries = [(f"panel {title!r}", expr) for title, expr in panel_queries(MODEL)]
        queries += [(f"recording rule {name}", name) for name in recording_rules()]
        missing = list(queries)
        deadline = time.monotonic() + 20  # recording rules: the next evaluation, within 1 s
        while missing and time.monotonic() < deadline:
            missing = [(what, expr) for what, expr in missing if not has_a_number(prom.query(expr))]
            if missing:
                time.sleep(0.5)
        assert not missing, "no data for:\n" + "\n".join(f"{w}: {e}" for w, e in missing)

        # the labels the panels split by hold what the load sent
        tenants = {r["metric"].get("tenant") for r in prom.query(
            "namespace_model_tenant:predictor_generation_tokens:rate5m"
        )}  # fmt: skip
        assert {TENANT, "none"} <= tenants
        reasons = {r["metric"]["reason"] for r in prom.query(
            f'predictor_request_errors_total{{model="{MODEL}"}}'
        )}  # fmt: skip
        assert "invalid_request" in reasons

        def evaluated() -> bool:
            groups = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
            health = [
                (r["name"], r["health"], r.get("lastError")) for g in groups for r in g["rules"]
            ]
            assert all(h != "err" for _, h, _ in health), health
            return all(h == "ok" for _, h, _ in health)

        prom.wait_for("every rule evaluated", evaluated)
