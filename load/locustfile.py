"""Locust load test for gptq-predictor: streaming latency and throughput per protocol.

User classes (pick with ``--class-picker`` in the web UI or name them on the command line):

- ``GenerateStreamUser``: REST ``POST /v2/models/{m}/generate_stream`` (SSE), read with httpx.
- ``GenerateUser``: REST ``POST /v2/models/{m}/generate`` (one JSON answer).
- ``InferUser``: REST V2 ``POST /v2/models/{m}/infer``.
- ``GrpcStreamUser``: Triton ``ModelStreamInfer`` via ``tritonclient.grpc``, one stream per user.
- ``OpenAIChatStreamUser``: OpenAI ``POST {prefix}/chat/completions`` with ``stream: true`` and
  ``stream_options.include_usage`` (SSE), each prompt one user message; works against any OpenAI
  server.

Every user is closed loop (``wait_time`` 0): it sends its next request when the last one ends.
Each call is one normal locust entry (type ``POST`` or ``gRPC``, name = the endpoint). A call
fails on an HTTP/gRPC error, an ``{"error": ...}`` event, or a stream without its final event.
Successful calls add their own entries, under the same name, so they show in the console, the
CSV files and the web UI:

- ``TTFT`` (ms, streaming users): from sending the request to the first event/response whose
  text is not empty.
- ``TPOT`` (ms, streaming users, only when 2+ tokens): (arrival of the final event, or of the last
  non-empty gRPC response) minus the first-token time, divided by (generated tokens - 1): the mean
  time per output token after the first, independent of how tokens were grouped into events.
- ``TOKENS`` (all users): the "response time" is the number of generated tokens reported by the
  server (``details.generated_tokens`` / the ``generated_tokens`` parameter / OpenAI's
  ``usage.completion_tokens``), so its *average*
  column is output tokens per request and average x count is the total (``load/run_load.py``
  divides that by the run time for tokens/s). It is a count, not milliseconds.

Note that locust's ``Aggregated`` row (and total requests/s) also counts these metric entries.

Settings: a locust option or, as its default, an environment variable:
``--model`` LOAD_MODEL (smollm2-135m-instruct-gptq), ``--max-tokens`` LOAD_MAX_TOKENS (64),
``--temperature`` LOAD_TEMPERATURE (0 = greedy), ``--top-p`` LOAD_TOP_P and ``--top-k``
LOAD_TOP_K (sent only when set), ``--chat`` LOAD_CHAT (1: apply the chat template),
``--grpc-target`` LOAD_GRPC_TARGET (127.0.0.1:8081), ``--prompts`` LOAD_PROMPTS
(load/prompts.txt: one prompt per line, each request picks one at random),
``--openai-prefix`` LOAD_OPENAI_PREFIX (/v1; KServe's is /openai/v1),
``--request-timeout`` LOAD_REQUEST_TIMEOUT (300 s), ``--exit-grace`` LOAD_EXIT_GRACE (15 s: how
long exit may stay blocked after the summary). The REST host is locust's ``--host``.

    .venv/bin/python -m locust -f load/locustfile.py --host http://127.0.0.1:8080 GenerateStreamUser

This file must not import ``predictor`` or ``kserve``: tritonclient.grpc cannot share a process
with kserve.
"""

from __future__ import annotations

import atexit
import csv
import functools
import itertools
import json
import logging
import os
import queue
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import gevent
import grpc.experimental.gevent as grpc_gevent
import httpx
import numpy as np
import tritonclient.grpc as grpcclient
from gevent import monkey
from locust import User, constant, events, task
from locust.env import Environment
from locust.runners import WorkerRunner
from locust.stats import PERCENTILES_TO_REPORT, StatsCSV

# locust runs on gevent: grpc must cooperate with it before any channel exists.
grpc_gevent.init_gevent()
logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request

PROMPTS = Path(__file__).with_name("prompts.txt")
METRICS = ("TTFT", "TPOT", "TOKENS")
EXIT_GRACE_S = 15.0  # default of --exit-grace
STOP_STREAM_S = 5.0  # how long a gRPC user's on_stop may wait for its stream to close


class Failure(Exception):
    """A failed call: reported as the failure of its locust entry."""


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    env = os.environ.get
    group = parser.add_argument_group("gptq-predictor load")
    group.add_argument("--model", default=env("LOAD_MODEL", "smollm2-135m-instruct-gptq"),
                       help="model name in the URL / request (LOAD_MODEL)")  # fmt: skip
    group.add_argument("--max-tokens", type=int, default=int(env("LOAD_MAX_TOKENS", "64")),
                       help="max_tokens per request (LOAD_MAX_TOKENS)")  # fmt: skip
    group.add_argument("--temperature", type=float, default=float(env("LOAD_TEMPERATURE", "0")),
                       help="0 = greedy (LOAD_TEMPERATURE)")  # fmt: skip
    group.add_argument("--top-p", default=env("LOAD_TOP_P", ""), help="LOAD_TOP_P; empty: unset")
    group.add_argument("--top-k", default=env("LOAD_TOP_K", ""), help="LOAD_TOP_K; empty: unset")
    group.add_argument("--chat", type=int, default=int(env("LOAD_CHAT", "1")),
                       help="1: apply the chat template (LOAD_CHAT)")  # fmt: skip
    group.add_argument("--grpc-target", default=env("LOAD_GRPC_TARGET", "127.0.0.1:8081"),
                       help="host:port of the gRPC server (LOAD_GRPC_TARGET)")  # fmt: skip
    group.add_argument("--prompts", default=env("LOAD_PROMPTS", str(PROMPTS)),
                       help="prompt file, one per line (LOAD_PROMPTS)")  # fmt: skip
    group.add_argument("--openai-prefix", default=env("LOAD_OPENAI_PREFIX", "/v1"),
                       help="path prefix of the OpenAI routes (LOAD_OPENAI_PREFIX)")  # fmt: skip
    group.add_argument("--request-timeout", type=float,
                       default=float(env("LOAD_REQUEST_TIMEOUT", "300")),
                       help="seconds per request (LOAD_REQUEST_TIMEOUT)")  # fmt: skip
    group.add_argument("--exit-grace", type=float,
                       default=float(env("LOAD_EXIT_GRACE", str(EXIT_GRACE_S))),
                       help="seconds exit may block after the run (LOAD_EXIT_GRACE)")  # fmt: skip


@events.init.add_listener
def _at_exit(environment: Environment, **_: Any) -> None:
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    finish: Callable[[], None] = lambda: None  # noqa: E731
    if prefix and not isinstance(environment.runner, WorkerRunner):
        finish = functools.partial(write_final_csv, environment, prefix)
        atexit.register(finish)

    @environment.events.quit.add_listener
    def _exit_within_grace(exit_code: int, **_: Any) -> None:
        """Ends the process --exit-grace s after locust's shutdown if exit is still blocked.

        Under gevent, interpreter exit joins every thread, and a tritonclient stream thread whose
        cancellation grpc never delivered (grpc issue #27340) keeps the process alive after the
        summary was printed. The watchdog is a real OS thread: it runs whatever the hub does.
        """
        grace = float(getattr(environment.parsed_options, "exit_grace", EXIT_GRACE_S))
        monkey.get_original("_thread", "start_new_thread")(_watchdog, (grace, exit_code, finish))


def _watchdog(grace: float, exit_code: int, finish: Callable[[], None]) -> None:
    monkey.get_original("time", "sleep")(grace)
    sys.stderr.write(f"locust: exit still blocked {grace:g} s after shutdown; leaving\n")
    finish()
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(exit_code)


def write_final_csv(environment: Environment, prefix: str) -> None:
    """Rewrites `{prefix}_stats.csv` and `_failures.csv` from the final stats, after locust closed
    them. Locust's CSV writer refreshes them once a second and is stopped before the run ends
    (locust issues #1806, #2299): calls that end in the last second, or while --stop-timeout lets
    calls in flight finish, are missing from its files though the console summary has them."""
    writer = StatsCSV(environment, PERCENTILES_TO_REPORT)
    with open(f"{prefix}_stats.csv", "w", newline="") as handle:
        writer.requests_csv(csv.writer(handle))
    with open(f"{prefix}_failures.csv", "w", newline="") as handle:
        writer.failures_csv(csv.writer(handle))


@dataclass(frozen=True)
class Settings:
    model: str
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    chat: bool
    grpc_target: str
    prompts: tuple[str, ...]
    timeout: float
    openai_prefix: str = "/v1"

    def parameters(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "chat": self.chat,
        }
        if self.top_p is not None:
            params["top_p"] = self.top_p
        if self.top_k is not None:
            params["top_k"] = self.top_k
        return params


@cache
def _prompts(path: str) -> tuple[str, ...]:
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    prompts = tuple(line for line in lines if line)
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def settings(environment: Environment) -> Settings:
    """The parsed locust options; the environment variables when locust runs as a library."""
    opts = environment.parsed_options
    env = os.environ.get

    def pick(name: str, var: str, default: str) -> Any:
        return (
            getattr(opts, name) if opts is not None and hasattr(opts, name) else env(var, default)
        )

    top_p, top_k = pick("top_p", "LOAD_TOP_P", ""), pick("top_k", "LOAD_TOP_K", "")
    return Settings(
        model=str(pick("model", "LOAD_MODEL", "smollm2-135m-instruct-gptq")),
        max_tokens=int(pick("max_tokens", "LOAD_MAX_TOKENS", "64")),
        temperature=float(pick("temperature", "LOAD_TEMPERATURE", "0")),
        top_p=float(top_p) if str(top_p).strip() else None,
        top_k=int(top_k) if str(top_k).strip() else None,
        chat=bool(int(pick("chat", "LOAD_CHAT", "1"))),
        grpc_target=str(pick("grpc_target", "LOAD_GRPC_TARGET", "127.0.0.1:8081")),
        prompts=_prompts(str(pick("prompts", "LOAD_PROMPTS", str(PROMPTS)))),
        timeout=float(pick("request_timeout", "LOAD_REQUEST_TIMEOUT", "300")),
        openai_prefix=str(pick("openai_prefix", "LOAD_OPENAI_PREFIX", "/v1")),
    )


class PredictorUser(User):
    """Shared plumbing: settings, a prompt picker and the entries fired into locust's stats."""

    abstract = True
    wait_time = constant(0)
    endpoint = ""  # the locust entry name of this user's calls
    request_type = "POST"

    def on_start(self) -> None:
        self.cfg = settings(self.environment)

    def prompt(self) -> str:
        return random.choice(self.cfg.prompts)

    def fire(self, request_type: str, value: float, length: int = 0, error: Any = None) -> None:
        self.environment.events.request.fire(
            request_type=request_type, name=self.endpoint, response_time=value,
            response_length=length, exception=error, context={},
        )  # fmt: skip

    def report(
        self, started: float, ended: float, length: int, tokens: int,
        first: float | None = None, last: float | None = None,
    ) -> None:  # fmt: skip
        """A successful call: its own entry, then TTFT/TPOT (streams) and TOKENS."""
        self.fire(self.request_type, (ended - started) * 1000, length)
        if first is not None:
            self.fire("TTFT", (first - started) * 1000)
            if last is not None and tokens > 1:
                self.fire("TPOT", (last - first) * 1000 / (tokens - 1))
        self.fire("TOKENS", tokens)


class RestUser(PredictorUser):
    abstract = True

    def on_start(self) -> None:
        super().on_start()
        self.http = httpx.Client(base_url=self.host or "", timeout=self.cfg.timeout)

    def on_stop(self) -> None:
        self.http.close()

    def url(self) -> str:
        return f"/v2/models/{self.cfg.model}/{self.endpoint}"

    def post_json(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        response = self.http.post(self.url(), json=body)
        if response.status_code != 200:
            raise Failure(f"HTTP {response.status_code}: {response.text[:200]}")
        return response.json(), len(response.content)

    def call(self, work: Any) -> None:
        """Runs one call; any ordinary exception becomes a failed entry (GreenletExit passes)."""
        started = time.perf_counter()
        try:
            work(started)
        except Exception as exc:  # every error is a failed request
            self.fire(self.request_type, (time.perf_counter() - started) * 1000, 0, exc)


class GenerateStreamUser(RestUser):
    endpoint = "generate_stream"

    @task
    def generate_stream(self) -> None:
        self.call(self._stream)

    def _stream(self, started: float) -> None:
        body = {"text_input": self.prompt(), "parameters": self.cfg.parameters()}
        first: float | None = None
        final: float | None = None
        details: dict[str, Any] | None = None
        length = 0
        with self.http.stream("POST", self.url(), json=body) as response:
            if response.status_code != 200:
                response.read()
                raise Failure(f"HTTP {response.status_code}: {response.text[:200]}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()
                length += len(line)
                event = json.loads(line[5:])
                if "error" in event:
                    raise Failure(f"error event: {event['error']}")
                if event.get("text_output") and first is None:
                    first = now
                if "details" in event:
                    details, final = event["details"], now
        ended = time.perf_counter()
        if details is None:
            raise Failure("stream ended without a final event")
        self.report(started, ended, length, int(details["generated_tokens"]), first, final)


class GenerateUser(RestUser):
    endpoint = "generate"

    @task
    def generate(self) -> None:
        self.call(self._generate)

    def _generate(self, started: float) -> None:
        body = {"text_input": self.prompt(), "parameters": self.cfg.parameters()}
        answer, length = self.post_json(body)
        if not isinstance(answer.get("text_output"), str):
            raise Failure(f"no text_output in {str(answer)[:200]}")
        tokens = int(answer["details"]["generated_tokens"])
        self.report(started, time.perf_counter(), length, tokens)


class InferUser(RestUser):
    endpoint = "infer"

    @task
    def infer(self) -> None:
        self.call(self._infer)

    def _infer(self, started: float) -> None:
        tensor = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [self.prompt()]}
        answer, length = self.post_json({"inputs": [tensor], "parameters": self.cfg.parameters()})
        outputs = {out["name"]: out for out in answer.get("outputs", [])}
        if "text_output" not in outputs:
            raise Failure(f"no text_output in {str(answer)[:200]}")
        tokens = int(answer["parameters"]["generated_tokens"])
        self.report(started, time.perf_counter(), length, tokens)


class OpenAIChatStreamUser(RestUser):
    """OpenAI streaming chat completions; the token count comes from the usage chunk."""

    endpoint = "openai_chat_stream"

    def url(self) -> str:
        return f"{self.cfg.openai_prefix}/chat/completions"

    @task
    def chat_stream(self) -> None:
        self.call(self._stream)

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": self.prompt()}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.cfg.top_p is not None:
            body["top_p"] = self.cfg.top_p
        if self.cfg.top_k is not None:
            body["top_k"] = self.cfg.top_k  # vLLM's extension, which this server takes too
        return body

    def _stream(self, started: float) -> None:
        first: float | None = None
        final: float | None = None
        tokens: int | None = None
        done = False
        length = 0
        with self.http.stream("POST", self.url(), json=self._body()) as response:
            if response.status_code != 200:
                response.read()
                raise Failure(f"HTTP {response.status_code}: {response.text[:200]}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()
                length += len(line)
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    raise Failure(f"error event: {event['error']}")
                for choice in event.get("choices", []):
                    if choice["delta"].get("content") and first is None:
                        first = now
                    if choice.get("finish_reason"):
                        final = now
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
        if not done or tokens is None:
            raise Failure("stream ended without its usage chunk and [DONE]")
        self.report(started, time.perf_counter(), length, tokens, first, final)


class GrpcStreamUser(PredictorUser):
    """tritonclient.grpc: one ModelStreamInfer stream per user, one request in flight on it."""

    endpoint = "grpc_stream"
    request_type = "gRPC"
    _ids = itertools.count()

    def on_start(self) -> None:
        super().on_start()
        self.client = grpcclient.InferenceServerClient(self.cfg.grpc_target)
        self.responses: queue.Queue[tuple[float, Any, Any]] = queue.Queue()
        self.client.start_stream(callback=self._arrived)

    def on_stop(self) -> None:
        # Bounded: a cancellation grpc never delivers would block the join of the stream's
        # thread here forever (the exit watchdog covers that thread at exit).
        with gevent.Timeout(STOP_STREAM_S, False):
            self.client.stop_stream(cancel_requests=True)
            self.client.close()

    def _arrived(self, result: Any, error: Any) -> None:
        self.responses.put((time.perf_counter(), result, error))

    def _restart(self) -> None:
        """After a failure the stream may be dead: cancel it and open a fresh one."""
        self.client.stop_stream(cancel_requests=True)
        self.responses = queue.Queue()
        self.client.start_stream(callback=self._arrived)

    @task
    def stream(self) -> None:
        started = time.perf_counter()
        try:
            self._request(started)
        except Exception as exc:  # every error is a failed request
            self.fire(self.request_type, (time.perf_counter() - started) * 1000, 0, exc)
            self._restart()

    def _request(self, started: float) -> None:
        rid = f"locust-{next(self._ids)}"
        tensor = grpcclient.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([self.prompt().encode()], dtype=np.object_))
        self.client.async_stream_infer(
            self.cfg.model, [tensor], request_id=rid, parameters=self.cfg.parameters(),
            enable_empty_final_response=True,
        )  # fmt: skip
        first: float | None = None
        last: float | None = None
        tokens: int | None = None
        length = 0
        deadline = started + self.cfg.timeout
        while True:
            try:
                now, result, error = self.responses.get(
                    timeout=max(deadline - time.perf_counter(), 0)
                )
            except queue.Empty:
                raise Failure(f"no final response in {self.cfg.timeout:.0f} s") from None
            if error is not None:  # the only request in flight on this stream
                raise Failure(f"gRPC error: {error}")
            response = result.get_response()
            if response.id != rid:
                continue  # a leftover of an earlier, abandoned request
            if response.parameters["triton_final_response"].bool_param and not response.outputs:
                break
            text = result.as_numpy("text_output")
            if text is not None and len(text[0]):
                length += len(text[0])
                first = first if first is not None else now
            last = now
            if "generated_tokens" in response.parameters:
                tokens = int(response.parameters["generated_tokens"].int64_param)
            if response.parameters["triton_final_response"].bool_param:
                break
        if tokens is None:
            raise Failure("stream ended without usage (generated_tokens)")
        self.report(started, time.perf_counter(), length, tokens, first, last)
