"""Soak test: a real server for a set time at about twice its measured capacity, with clients
that disconnect mid-stream and clients that send bad requests.

Reports broken streams (must be 0), the classes of outcome with their counts, and the server
process's RSS at start, peak and end. Traffic goes to 127.0.0.1 only; it stops by itself.

    .venv/bin/python -m load.soak --seconds 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter

import httpx

from load.local_server import REPO, LocalServer, local_server

PROMPTS = [p for p in (REPO / "load" / "prompts.txt").read_text().splitlines() if p.strip()]


async def stream(client: httpx.AsyncClient, url: str, body: dict, drop_after: int | None) -> str:
    """One generate_stream call; returns its outcome class."""
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"http_{response.status_code}"
            events = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "error_event"
                events += 1
                if drop_after is not None and events >= drop_after:
                    return "disconnected_on_purpose"
                if "finish_reason" in event:
                    return f"finished_{event['finish_reason']}"
            return "broken"  # the stream ended without its final event
    except httpx.HTTPError as exc:
        return f"broken_{type(exc).__name__}"


async def one_request(client: httpx.AsyncClient, base: str, model: str, rng: random.Random) -> str:
    try:
        return await _one_request(client, f"{base}/v2/models/{model}", rng)
    except httpx.HTTPError as exc:
        return f"broken_{type(exc).__name__}"


async def _one_request(client: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    prompt = rng.choice(PROMPTS)
    params = {"max_tokens": rng.randint(8, 64), "chat": True, "temperature": rng.choice([0, 0.7])}
    kind = rng.random()
    if kind < 0.10:  # a bad request: must be a 4xx with {"error"}, never a 5xx
        bad = rng.choice([{"max_tokens": 0}, {"top_p": 7}, {"stop": 5}, {"temperature": "hot"}])
        r = await client.post(f"{url}/generate", json={"text_input": prompt, "parameters": bad})
        return (
            "bad_request_rejected" if r.status_code == 400 else f"bad_request_http_{r.status_code}"
        )
    if kind < 0.15:
        tensor = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [prompt]}
        r = await client.post(f"{url}/infer", json={"inputs": [tensor], "parameters": params})
        return "infer_ok" if r.status_code == 200 else f"http_{r.status_code}"
    drop = rng.randint(1, 4) if kind < 0.30 else None  # 15%: the client leaves mid-stream
    return await stream(
        client, f"{url}/generate_stream", {"text_input": prompt, "parameters": params}, drop
    )


async def measure_capacity(
    client: httpx.AsyncClient, base: str, model: str, seconds: float
) -> float:
    """Requests/s that 16 closed-loop streaming clients complete."""
    done, stop = 0, time.monotonic() + seconds
    rng = random.Random(1)

    async def user() -> None:
        nonlocal done
        while time.monotonic() < stop:
            body = {
                "text_input": rng.choice(PROMPTS),
                "parameters": {"max_tokens": 36, "chat": True},
            }
            await stream(client, f"{base}/v2/models/{model}/generate_stream", body, None)
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(user() for _ in range(16)))
    return done / (time.monotonic() - started)


async def soak(args: argparse.Namespace, server: LocalServer) -> None:
    base = server.base_url
    limits = httpx.Limits(max_connections=args.max_open + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        capacity = await measure_capacity(client, base, args.model, args.probe_seconds)
        rate = args.load_factor * capacity
        rss_start = server.rss_mib()
        print(
            f"capacity {capacity:.2f} req/s; soaking {args.seconds:.0f} s at {rate:.2f} req/s "
            f"({args.load_factor:.1f}x); server RSS at start {rss_start:.0f} MiB",
            flush=True,
        )
        outcomes: Counter[str] = Counter()
        rng = random.Random(args.seed)
        open_requests: set[asyncio.Task[str]] = set()
        peak_rss, started = rss_start, time.monotonic()
        next_report = started + 60
        while (now := time.monotonic()) < started + args.seconds:
            if len(open_requests) < args.max_open:
                task = asyncio.create_task(one_request(client, base, args.model, rng))
                open_requests.add(task)
                task.add_done_callback(
                    lambda t: (open_requests.discard(t), outcomes.update([t.result()]))
                )
            else:
                outcomes["client_side_skipped"] += 1  # bounded: never more than --max-open
            await asyncio.sleep(rng.expovariate(rate))
            if now >= next_report:
                peak_rss = max(peak_rss, server.rss_mib())
                print(
                    f"  {now - started:5.0f} s: {sum(outcomes.values())} done, "
                    f"{len(open_requests)} open, RSS {server.rss_mib():.0f} MiB",
                    flush=True,
                )
                next_report += 60
        await asyncio.gather(*open_requests, return_exceptions=True)
        await asyncio.sleep(2)
        rss_end = server.rss_mib()
        peak_rss = max(peak_rss, rss_end)
        metrics = (await client.get(f"{base}/metrics")).text
    broken = sum(n for k, n in outcomes.items() if k.startswith("broken") or k.startswith("http_5"))
    print("\noutcome                          count")
    for key, count in sorted(outcomes.items()):
        print(f"{key:<32} {count:>6}")
    running = [ln for ln in metrics.splitlines() if ln.startswith("predictor_num_requests_")]
    print("\n" + "\n".join(running))
    print(f"\nbroken streams: {broken}")
    print(f"server RSS: start {rss_start:.0f} MiB, peak {peak_rss:.0f} MiB, end {rss_end:.0f} MiB")
    if broken:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--model-dir", default="models/smollm2-135m-instruct-gptq")
    parser.add_argument("--model", default="soak")
    parser.add_argument("--load-factor", type=float, default=2.0)
    parser.add_argument("--probe-seconds", type=float, default=20)
    parser.add_argument("--max-open", type=int, default=400)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--server-args", default="", help="extra flags for python -m predictor")
    args = parser.parse_args()
    log_file = REPO / "load" / "soak-server.log"
    extra = args.server_args.split()
    with local_server(args.model_dir, args.model, log_file, extra) as server:
        asyncio.run(soak(args, server))


if __name__ == "__main__":
    main()
