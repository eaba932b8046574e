"""What a sleep saves and what a wake costs: RSS awake (after traffic filled some of the KV
cache) and asleep, and the first token's time awake against the first request after a sleep
(which waits for the wake), on one server with --enable-sleep-mode.

    python -m load.bench_sleep [--model-dir DIR] [--rounds 3] [--fill 4] [--words 100]
        [--threads N]

Each round: `--fill` distinct ~300-token prompts (the KV cache's pages touched), then a streamed
request's time to first token awake, RSS; POST /sleep (its time), RSS a second later; then the
same streamed request again: its time to first token includes the wake, and the server's
predictor_wake_up_seconds says how much of it the wake was. Medians over the rounds, as a
Markdown table for load/RESULTS.md ("Sleep and wake").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from load.local_server import LocalServer, local_server
from predictor.model.env import cpu_name

DEFAULT_MODEL = "models/smollm2-135m-instruct-gptq"
PROBE = "The capital of France is"


@dataclass
class Round:
    rss_awake: float  # MiB, after the fill
    rss_asleep: float
    sleep_s: float  # POST /sleep's answer time
    ttft_awake: float
    ttft_woken: float  # the first request after the sleep: the wake included
    wake_s: float  # the server's own figure for the wake (predictor_wake_up_seconds)


def first_token_seconds(client: httpx.Client, model: str, prompt: str) -> float:
    """A streamed completion's time to its first text."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    started = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():  # all of it: the row ends before the next request
            if first is None and line.startswith("data: {") and has_text(line):
                first = time.perf_counter() - started
    if first is not None:
        return first
    raise RuntimeError("the stream ended without text")


def has_text(line: str) -> bool:
    """An SSE data line of a completion chunk with some text."""
    return any(choice["text"] for choice in json.loads(line.removeprefix("data: "))["choices"])


def wake_seconds_sum(client: httpx.Client) -> float:
    found = re.search(r"^predictor_wake_up_seconds_sum\{[^}]*\} (\S+)$",
                      client.get("/metrics").text, re.M)  # fmt: skip
    return float(found.group(1)) if found else 0.0


def fill(client: httpx.Client, model: str, count: int, round_no: int, length: int) -> None:
    """Distinct long prompts, so their KV blocks are written (the pages count in RSS)."""
    for i in range(count):
        words = " ".join(f"w{round_no}-{i}-{j}" for j in range(length))
        body = {"model": model, "prompt": words, "max_tokens": 4, "temperature": 0}
        client.post("/v1/completions", json=body).raise_for_status()


def one_round(
    server: LocalServer, client: httpx.Client, model: str, fills: tuple[int, int], n: int
) -> Round:
    fill(client, model, fills[0], n, fills[1])
    ttft_awake = first_token_seconds(client, model, PROBE)
    rss_awake = server.rss_mib()
    before = wake_seconds_sum(client)
    started = time.perf_counter()
    client.post("/sleep").raise_for_status()
    sleep_s = time.perf_counter() - started
    time.sleep(1.0)
    rss_asleep = server.rss_mib()
    assert client.get("/is_sleeping").json()["is_sleeping"]
    ttft_woken = first_token_seconds(client, model, PROBE)
    wake_s = wake_seconds_sum(client) - before
    return Round(rss_awake, rss_asleep, sleep_s, ttft_awake, ttft_woken, wake_s)


def table(rounds: Sequence[Round], model_dir: str) -> str:
    def median(field: str) -> float:
        return statistics.median(getattr(r, field) for r in rounds)

    return "\n".join([
        f"`{Path(model_dir).name}`, {len(rounds)} rounds (medians), {cpu_name()}, "
        f"{os.cpu_count()} cores:",
        "",
        "| RSS awake | RSS asleep | sleep | wake | TTFT awake | TTFT after a sleep |",
        "|---|---|---|---|---|---|",
        f"| {median('rss_awake'):.0f} MiB | {median('rss_asleep'):.0f} MiB "
        f"| {median('sleep_s'):.2f} s | {median('wake_s'):.2f} s "
        f"| {median('ttft_awake') * 1000:.0f} ms | {median('ttft_woken'):.2f} s |",
    ])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fill", type=int, default=4, help="long prompts before each round")
    parser.add_argument("--words", type=int, default=100, help="words of each (~3 tokens each)")
    parser.add_argument("--threads", type=int, default=0, help="the server's --threads")
    args = parser.parse_args(argv)
    name = "bench"
    extra = ["--enable-sleep-mode", "--threads", str(args.threads)]
    log = Path(tempfile.mkdtemp(prefix="bench-sleep-")) / "server.log"
    with (
        local_server(args.model_dir, name, log, extra) as server,
        httpx.Client(base_url=server.base_url, timeout=600) as client,
    ):
        first_token_seconds(client, name, PROBE)  # warm
        rounds = [
            one_round(server, client, name, (args.fill, args.words), n) for n in range(args.rounds)
        ]
    result = table(rounds, args.model_dir)
    print(result)
    return result


if __name__ == "__main__":
    main()
