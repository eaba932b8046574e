"""Every metric a manifest refers to (KEDA queries, the endpoint picker's flags) is in a live
/metrics scrape of the server, started the way the ClusterServingRuntime starts it: its own args
and env with {{.Name}} filled as KServe fills it, on the tiny checkpoint one folder down in the
model folder, as KServe's storage initializer may leave it. The KV-cache gauge is read while
streams run and after they end."""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.kinds import effective_pod, referenced_metrics
from tests.deploy.test_kinds import build, runtimes
from tests.support import ServerProcess

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")


def scrape(base_url: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if match := SAMPLE.match(line):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match[2] or ""))
            samples.append((match[1], labels, float(match[3])))
    return samples


@pytest.fixture(scope="module")
def runtime_server(
    tiny_gptq_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    isvc = next(d for d in build("inference-pool") if d["kind"] == "InferenceService")
    container, _, errors = effective_pod(isvc, runtimes())
    assert errors == []
    models = tmp_path_factory.mktemp("mnt") / "models"
    shutil.copytree(tiny_gptq_dir, models / "tiny-gptq")  # one folder down
    (models / ".cache").mkdir()
    args = [a for a in container["args"] if not a.startswith(("--model-dir", "--host", "--http",
                                                              "--grpc"))]  # fmt: skip
    assert args == ["--model-name=gptq-predictor"]
    env = [f"--{e['name'][len('PREDICTOR_'):].lower().replace('_', '-')}={e['value']}"
           for e in container["env"] if e["name"] not in ("PREDICTOR_DEVICE", "PREDICTOR_THREADS")]  # fmt: skip
    assert "--vllm-metric-aliases=true" in env
    with ServerProcess.start(models, "gptq-predictor", extra=[*env, "--max-cache-tokens=400"]) as s:
        yield s


def test_every_referenced_metric_is_served(runtime_server: ServerProcess) -> None:
    served = scrape(runtime_server.base_url)
    wanted = referenced_metrics(build("inference-pool"))
    assert {w for w, _, _ in wanted} >= {
        "predictor_num_requests_waiting",
        "predictor_num_requests_running",
        "predictor_kv_cache_usage_ratio",
    }
    for name, matchers, where in wanted:
        series = [labels for metric, labels, _ in served if metric == name]
        assert any(all(labels.get(k) == v for k, v in matchers.items()) for labels in series), (
            f"{where}: {name}{matchers} is not in the scrape"
        )
    names = {metric for metric, _, _ in served}
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc"} <= names  # fmt: skip


# alone: the gauge is sampled by scrapes while 4 short generations run; beside a busy neighbour
# a fresh clone's run once got two scrapes in, one before and one after (0.08, 0.0)
@pytest.mark.serial
def test_kv_cache_gauge_tracks_a_load_run(runtime_server: ServerProcess) -> None:
    def kv() -> float:
        values = [v for m, lbl, v in scrape(runtime_server.base_url)
                  if m == "predictor_kv_cache_usage_ratio" and lbl.get("model") == "gptq-predictor"]  # fmt: skip
        assert len(values) == 1
        return values[0]

    assert kv() == 0.0
    url = f"{runtime_server.base_url}/v2/models/gptq-predictor/generate"
    body = {"text_input": "Count slowly", "parameters": {"max_tokens": 90}}
    threads = [
        threading.Thread(target=lambda: httpx.post(url, json=body, timeout=120).raise_for_status())
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    seen = []
    while any(t.is_alive() for t in threads):
        seen.append(kv())
    for t in threads:
        t.join()
    print("kv-cache usage during the run:", [round(v, 3) for v in seen])
    assert max(seen) > 0.2 and all(0.0 <= v <= 1.0 for v in seen)
    assert kv() == 0.0
