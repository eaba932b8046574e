"""429 on the OpenAI routes, in OpenAI's error shape, as on the other routes (503: test_drain.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serving.test_grpc_stream import wait_idle
from tests.serving.test_overload import full_queue
from tests.support import ServerProcess

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def test_full_queue_is_429_rate_limit_error(small: ServerProcess) -> None:
    with full_queue(small):
        for stream in (False, True):
            r = httpx.post(
                f"{small.base_url}/v1/chat/completions", json=CHAT | {"stream": stream}, timeout=10
            )
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        sdk = openai.OpenAI(base_url=f"{small.base_url}/openai/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            sdk.completions.create(model="tiny", prompt="x", max_tokens=2)


def test_n_choices_past_the_queue_are_refused_whole(small: ServerProcess) -> None:
    # 1 row + 1 waiting place: a third choice does not fit, and none of them is left running
    r = httpx.post(f"{small.base_url}/v1/completions", json={"model": "tiny", "prompt": "x",
                   "n": 3, "max_tokens": 400, "stream": True}, timeout=30)  # fmt: skip
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    wait_idle(small)


# A draining server's 503 on the OpenAI routes: tests/serving/test_drain.py (one draining server
# answers every route).
