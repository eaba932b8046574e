"""vLLM's request `priority` through the real server: with every row taken, a more urgent request
preempts the running one and finishes first, and the preempted stream resumes to its end; one of
the same priority waits its turn; the field is checked like every other."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support import ServerProcess


@pytest.fixture(scope="module")
def one_row(tiny_gptq_dir: Path) -> Iterator[ServerProcess]:
    extra = ["--max-batch-size", "1", "--max-tokens-limit", "512"]
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as proc:
        yield proc


def stream(base: str, tokens: int, events: list[dict], started: threading.Event) -> None:
    # without drafts: a random model repeats itself, and drafting 9 tokens a step its stream
    # could end before the short request arrives; this test needs one step a token
    parameters = {"max_tokens": tokens, "ignore_eos": True, "speculative": False}
    body = {"text_input": "Go on", "parameters": parameters}
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{base}/v2/models/tiny/generate_stream", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]) | {"at": time.monotonic()})
                started.set()


def behind_a_stream(server: ServerProcess, tokens: int, priority: int) -> tuple[float, float, int]:
    """A long stream holds the only row; a short request of `priority` arrives. Returns when
    each finished, and how many events the stream sent."""
    events: list[dict] = []
    started = threading.Event()
    reader = threading.Thread(target=stream, args=(server.base_url, tokens, events, started))
    reader.start()
    assert started.wait(60)
    body = {"text_input": "Hi", "parameters": {"max_tokens": 4, "priority": priority}}
    r = httpx.post(f"{server.base_url}/v2/models/tiny/generate", json=body, timeout=120)
    short_done = time.monotonic()
    assert r.status_code == 200, r.text
    reader.join(120)
    assert events and events[-1]["finish_reason"] == "length"
    return short_done, events[-1]["at"], len(events)


def test_an_urgent_request_preempts_the_running_row_and_finishes_first(
    one_row: ServerProcess,
) -> None:
    short_done, stream_done, sent = behind_a_stream(one_row, 300, priority=-1)
    assert short_done < stream_done
    assert sent == 300  # the preempted stream resumed where it stopped: every token, once


def test_a_request_of_the_same_priority_waits_for_the_row(one_row: ServerProcess) -> None:
    short_done, stream_done, _ = behind_a_stream(one_row, 60, priority=0)
    assert stream_done < short_done


def test_priority_is_an_integer_on_every_protocol(one_row: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{one_row.base_url}/v1", api_key="x", max_retries=0)
    done = client.completions.create(model="tiny", prompt="Hi", max_tokens=2,
                                     extra_body={"priority": 5})  # fmt: skip
    assert done.usage is not None and done.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2,
                                  extra_body={"priority": "high"})  # fmt: skip
    body = {"text_input": "Hi", "parameters": {"max_tokens": 2, "priority": 1.5}}
    r = httpx.post(f"{one_row.base_url}/v2/models/tiny/generate", json=body, timeout=30)
    assert r.status_code == 400 and "priority" in r.json()["error"]
