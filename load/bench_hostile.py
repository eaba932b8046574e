"""Plain requests while hostile grammars compile (a script, not a test).

The default model served with default flags; a plain 4-token generate request's latency and a
running stream's inter-token gaps, idle and with 8 slow-to-compile structured-output requests
in flight (distinct regexes xgrammar takes ~1.5 s each to compile here), in one run.

    .venv/bin/python -m load.bench_hostile [--model-dir models/smollm2-135m-instruct-gptq]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from load.local_server import LocalServer, local_server

SLOW = "[^x]{{0,{}}}y"


def plain(server: LocalServer) -> float:
    body = {"text_input": "What is the capital of France?", "parameters": {"max_tokens": 4}}
    started = time.perf_counter()
    reply = httpx.post(f"{server.base_url}/v2/models/m/generate", json=body, timeout=120)
    reply.raise_for_status()
    return time.perf_counter() - started


def stream_gaps(server: LocalServer, tokens: int = 64) -> list[float]:
    body = {"text_input": "Tell me a story.", "parameters": {"max_tokens": tokens,
            "ignore_eos": True}}  # fmt: skip
    stamps = []
    url = f"{server.base_url}/v2/models/m/generate_stream"
    with httpx.stream("POST", url, json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data:"):
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def hostile(server: LocalServer, count: int, offset: int) -> list[threading.Thread]:
    def send(i: int) -> None:
        body = {"text_input": "x", "parameters": {"max_tokens": 4,
                "structured_outputs": {"regex": SLOW.format(offset + i)}}}  # fmt: skip
        httpx.post(f"{server.base_url}/v2/models/m/generate", json=body, timeout=120)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="models/smollm2-135m-instruct-gptq")
    parser.add_argument("--hostile", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    log = Path(tempfile.mkstemp(prefix="bench-hostile-", suffix=".log")[1])
    with local_server(args.model_dir, "m", log) as server:
        for _ in range(3):
            plain(server)  # warm
        idle = statistics.median(plain(server) for _ in range(args.rounds))
        idle_gap = statistics.median(stream_gaps(server))
        threads = hostile(server, args.hostile, 5000)
        time.sleep(0.3)
        loaded = statistics.median(plain(server) for _ in range(args.rounds))
        threads += hostile(server, args.hostile, 6000)
        time.sleep(0.3)
        loaded_gap = statistics.median(stream_gaps(server))
        for thread in threads:
            thread.join()
    print(f"plain 4-token request: idle {idle * 1000:.0f} ms, with {args.hostile} hostile "
          f"compiles in flight {loaded * 1000:.0f} ms ({loaded / idle:.2f}x)")  # fmt: skip
    print(f"stream inter-token gap (median): idle {idle_gap * 1000:.1f} ms, with hostile "
          f"{loaded_gap * 1000:.1f} ms ({loaded_gap / idle_gap:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
