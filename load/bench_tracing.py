"""What tracing and payload records cost (a script, not a test).

Three servers of the same model: telemetry off; traces to a live OTLP/gRPC receiver plus hashed
payload records to a live CloudEvents sink (both real, in this process); and both pointed at a
port where nothing listens. Each is driven in turn, round after round (the machine is shared
and noisy), at C concurrent streams of N tokens; tokens/s and request latency are compared with
the off server's in the same round, and the dropped-span counter is read at the end.

    .venv/bin/python -m load.bench_tracing [--model-dir models/smollm2-135m-instruct-gptq]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from load.local_server import LocalServer, free_port, local_server
from load.receivers import cloudevent_sink, otlp_grpc_receiver


async def drive(server: LocalServer, concurrency: int, tokens: int, requests: int) -> dict:
    """`requests` streams of `tokens` tokens, `concurrency` at a time: tokens/s and latencies."""
    latencies: list[float] = []
    url = f"{server.base_url}/v1/completions"
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": "m", "prompt": f"Story {i}: once upon a time", "max_tokens": tokens,
                "ignore_eos": True, "user": f"team-{i % 4}"}  # fmt: skip
        async with limit:
            start = time.perf_counter()
            reply = await client.post(url, json=body, headers={
                "traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"})  # fmt: skip
            reply.raise_for_status()
            latencies.append(time.perf_counter() - start)

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(requests)))
        wall = time.perf_counter() - start
    return {"tok_s": requests * tokens / wall, "p50": statistics.median(latencies),
            "max": max(latencies)}  # fmt: skip


def dropped(server: LocalServer) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("predictor_otel_spans_dropped_total "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="models/smollm2-135m-instruct-gptq")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    dead = f"http://127.0.0.1:{free_port()}"
    common = ["--threads", str(args.threads), "--max-batch-size", str(args.concurrency)]
    with contextlib.ExitStack() as stack:
        endpoint, spans = stack.enter_context(otlp_grpc_receiver())
        sink, records = stack.enter_context(cloudevent_sink())
        configs = {
            "off": [],
            "on": ["--otlp-traces-endpoint", endpoint, "--log-payloads", "hash",
                   "--payload-logger-url", sink],
            "unreachable": ["--otlp-traces-endpoint", dead, "--log-payloads", "hash",
                            "--payload-logger-url", dead],
        }  # fmt: skip
        servers = {}
        for name, extra in configs.items():
            log = Path(tempfile.mkstemp(prefix=f"bench-tracing-{name}-", suffix=".log")[1])
            servers[name] = stack.enter_context(
                local_server(args.model_dir, "m", log, [*common, *extra])
            )
        for server in servers.values():  # warm: first requests, autotune'd kernels settle
            asyncio.run(drive(server, args.concurrency, 8, args.concurrency))
        rounds: dict[str, list[dict]] = {name: [] for name in servers}
        for _ in range(args.rounds):
            for name, server in servers.items():
                rounds[name].append(
                    asyncio.run(drive(server, args.concurrency, args.tokens, args.requests))
                )
        lost = dropped(servers["unreachable"])
        received = len(spans.got), len(records.got)
    off = rounds["off"]
    print(f"C={args.concurrency}, {args.requests} requests of {args.tokens} tokens, "
          f"{args.rounds} rounds, {args.threads} thread(s)")  # fmt: skip
    print("| telemetry | tokens/s per round | vs off, per round | median | p50 latency | max |")
    print("|---|---|---|---|---|---|")
    for name, runs in rounds.items():
        ratios = " / ".join(
            f"{r['tok_s'] / o['tok_s']:.3f}" for r, o in zip(runs, off, strict=True)
        )
        speeds = " / ".join(f"{r['tok_s']:.1f}" for r in runs)
        median = statistics.median(r["tok_s"] / o["tok_s"] for r, o in zip(runs, off, strict=True))
        print(f"| {name} | {speeds} | {ratios} | {median:.3f} | "
              f"{statistics.median(r['p50'] for r in runs) * 1000:.0f} ms | "
              f"{max(r['max'] for r in runs) * 1000:.0f} ms |")  # fmt: skip
    print(f"live receiver: {received[0]} spans, {received[1]} payload records; "
          f"unreachable: {lost:.0f} spans dropped and counted")  # fmt: skip


if __name__ == "__main__":
    main()
