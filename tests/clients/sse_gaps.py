"""SSE streams read in their own process, so that what the test process does meanwhile (send a
4 MiB body) cannot delay their clocks. Prints one JSON line: each stream's arrival times
(`time.monotonic()`, the same clock in every process on Linux) of its data events, after a
line `streaming` printed once every stream has its first event. A line on
stdin (or its end) closes each stream early, once it has MIN_EVENTS events, as a client that goes
away does, so a test waits only as long as it needs the streams.

usage: python -m tests.clients.sse_gaps BASE_URL MODEL STREAMS MAX_TOKENS [MIN_EVENTS]
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx


def read(
    base_url: str,
    model: str,
    index: int,
    tokens: int,
    out: list[list[float]],
    stop: threading.Event,
    min_events: int,
    first: threading.Barrier,
) -> None:
    body = {
        "text_input": f"Tell story number {index}.",
        "parameters": {"max_tokens": tokens, "ignore_eos": True},
    }
    url = f"{base_url}/v2/models/{model}/generate_stream"
    with httpx.Client(timeout=300) as client, client.stream("POST", url, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out[index].append(time.monotonic())
                if len(out[index]) == 1:
                    first.wait(timeout=120)  # broken (all raise) if a stream never starts
            if stop.is_set() and len(out[index]) >= min_events:
                return


def main() -> None:
    base_url, model, streams, tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:5])
    min_events = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    stop = threading.Event()
    first = threading.Barrier(streams, action=lambda: print("streaming", flush=True))
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    threads = [
        threading.Thread(
            target=read,
            args=(base_url, model, i, tokens, arrivals, stop, min_events, first),
        )
        for i in range(streams)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(arrivals))


if __name__ == "__main__":
    main()
