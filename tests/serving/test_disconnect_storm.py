"""50 clients that drop mid-stream leave no running rows and no leaked tasks."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.serving.test_grpc_stream import wait_idle
from tests.support import ServerProcess


def gauge(server: ServerProcess, name: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not exported")


async def drop_after_first_event(client: httpx.AsyncClient, url: str, i: int) -> bool:
    body = {"text_input": f"Story {i}", "parameters": {"max_tokens": 500}}
    async with client.stream("POST", url, json=body) as response:
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                return True  # leaving the block closes the connection mid-stream
    return False


def test_disconnect_storm(server: ServerProcess) -> None:
    url = f"{server.base_url}/v2/models/tiny/generate_stream"
    httpx.post(
        f"{server.base_url}/v2/models/tiny/generate",
        json={"text_input": "warm", "parameters": {"max_tokens": 2}},
        timeout=30,
    )
    baseline = gauge(server, "predictor_event_loop_tasks")

    async def storm() -> list[bool]:
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(
                *(drop_after_first_event(client, url, i) for i in range(50))
            )

    assert all(asyncio.run(storm()))
    wait_idle(server, timeout=30)
    assert gauge(server, "predictor_num_requests_waiting") == 0
    deadline = time.monotonic() + 10
    while gauge(server, "predictor_event_loop_tasks") > baseline + 2:
        assert time.monotonic() < deadline, "event loop tasks leaked"
        time.sleep(0.2)
    # and the server still serves
    r = httpx.post(
        f"{server.base_url}/v2/models/tiny/generate",
        json={"text_input": "after", "parameters": {"max_tokens": 3}},
        timeout=30,
    )
    assert r.json()["details"]["generated_tokens"] == 3
