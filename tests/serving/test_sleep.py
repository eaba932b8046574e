"""Sleep through the real server: --sleep-idle-seconds frees the model and a request wakes it
with the same greedy text; vLLM's POST /sleep, /wake_up and GET /is_sleeping; readiness stays
true while asleep; a stream of concurrent requests across sleeps all succeed; the metrics count
it; a KV-events subscriber hears AllBlocksCleared; without --enable-sleep-mode the POSTs are
refused."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import zmq

from load.local_server import free_port
from tests.serving.test_kv_events import Events
from tests.support import ServerProcess

IDLE = 3  # --sleep-idle-seconds
PROMPTS = [f"Tell me about the number {i}" for i in range(8)]


@pytest.fixture(scope="module")
def sleepy(tiny_gptq_dir: Path) -> Iterator[tuple[ServerProcess, int]]:
    port = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "topic": "kv@test"}  # fmt: skip
    extra = ["--sleep-idle-seconds", str(IDLE), "--enable-sleep-mode",
             "--kv-events-config", json.dumps(config)]  # fmt: skip
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as proc:
        yield proc, port


@pytest.fixture(scope="module")
def server(sleepy: tuple[ServerProcess, int]) -> ServerProcess:
    return sleepy[0]


def complete(server: ServerProcess, prompt: str, max_tokens: int = 12) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def sleeping(server: ServerProcess) -> bool:
    r = httpx.get(f"{server.base_url}/is_sleeping", timeout=10)
    assert r.status_code == 200, r.text
    return bool(r.json()["is_sleeping"])


def wait_asleep(server: ServerProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not sleeping(server):
        assert time.monotonic() < deadline, "the server did not fall asleep"
        time.sleep(0.2)


def metric(server: ServerProcess, name: str, labels: str = 'model="tiny"') -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    assert found, f"{name}{{{labels}}} is not on /metrics"
    return float(found.group(1))


def ready(server: ServerProcess) -> list[int]:
    """The readiness probes' answers: KServe's server and model, vLLM's /health."""
    paths = ("/v2/health/ready", "/v2/models/tiny/ready", "/health")
    return [httpx.get(server.base_url + p, timeout=10).status_code for p in paths]


@pytest.fixture(scope="module")
def awake_texts(server: ServerProcess) -> list[str]:
    """Each prompt's greedy text from the model loaded at the start, before any sleep."""
    assert not sleeping(server)
    return [complete(server, p) for p in PROMPTS]


def test_idle_sleep_then_a_request_wakes_it_with_the_same_text(
    sleepy: tuple[ServerProcess, int], awake_texts: list[str]
) -> None:
    server, port = sleepy
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        complete(server, PROMPTS[0] * 4)  # full blocks in the prefix cache, then idle
        wakes = metric(server, "predictor_wake_ups_total")
        wait_asleep(server)
        events = Events(sub).until(lambda new: ["AllBlocksCleared"] in new)
        assert ["AllBlocksCleared"] in events
    finally:
        sub.close(linger=0)
    assert ready(server) == [200, 200, 200]  # the pod stays in the endpoints while asleep
    assert metric(server, "predictor_sleeping") == 1
    assert metric(server, "predictor_sleeps_total", 'model="tiny",reason="idle"') >= 1
    started = time.monotonic()
    assert complete(server, PROMPTS[1]) == awake_texts[1]
    assert time.monotonic() - started < 60
    assert not sleeping(server)
    assert metric(server, "predictor_wake_ups_total") == wakes + 1
    assert metric(server, "predictor_wake_up_seconds_count") >= 1
    assert metric(server, "predictor_sleeping") == 0


def test_sleep_is_sleeping_and_wake_up(server: ServerProcess, awake_texts: list[str]) -> None:
    r = httpx.post(f"{server.base_url}/sleep", params={"level": "1"}, timeout=60)
    assert r.status_code == 200, r.text
    assert sleeping(server) and ready(server) == [200, 200, 200]
    r = httpx.post(f"{server.base_url}/sleep", params={"level": "3"}, timeout=60)
    assert r.status_code == 400 and "level" in r.text
    r = httpx.post(f"{server.base_url}/wake_up", params={"tags": "weights"}, timeout=120)
    assert r.status_code == 200, r.text
    assert not sleeping(server)  # --sleep-idle-seconds counts from the wake
    assert complete(server, PROMPTS[2]) == awake_texts[2]
    r = httpx.post(f"{server.base_url}/wake_up", timeout=60)  # awake: nothing to do
    assert r.status_code == 200 and not sleeping(server)


def test_concurrent_requests_across_sleeps_all_succeed(
    server: ServerProcess, awake_texts: list[str]
) -> None:
    """Requests stream in while POST /sleep lands three times (each preempting the running
    rows, which a wake recomputes) and the idle timer may sleep it too: every request ends
    200 with the text it had awake."""
    asleep_before = metric(server, "predictor_sleeps_total", 'model="tiny",reason="asked"')
    stop = time.monotonic() + 20

    def client(worker: int) -> int:
        done = 0
        while time.monotonic() < stop or done < 2:
            i = (worker + done) % len(PROMPTS)
            assert complete(server, PROMPTS[i], 12) == awake_texts[i]
            done += 1
        return done

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, w) for w in range(8)]
        for _ in range(3):
            time.sleep(3)
            r = httpx.post(f"{server.base_url}/sleep", timeout=60)
            assert r.status_code == 200, r.text
        counts = [f.result() for f in futures]
    assert sum(counts) >= 16
    asked = metric(server, "predictor_sleeps_total", 'model="tiny",reason="asked"')
    assert asked >= asleep_before + 3


def test_without_enable_sleep_mode_the_posts_are_refused(small: ServerProcess) -> None:
    for path in ("/sleep", "/wake_up"):
        r = httpx.post(f"{small.base_url}{path}", timeout=10)
        assert r.status_code == 403 and "--enable-sleep-mode" in r.text
    r = httpx.get(f"{small.base_url}/is_sleeping", timeout=10)
    assert r.status_code == 200 and r.json() == {"is_sleeping": False}
