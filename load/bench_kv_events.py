"""What KV-cache events cost (a script, not a test): --kv-events-config on against off.

Three servers of the same model: events off; on (sha256_cbor hashes, ZeroMQ PUB) with a
subscriber attached that receives and decodes every batch, as a router would; and on with no
subscriber (ZeroMQ drops what no one reads). Each is driven in turn, round after round (the
machine is shared and noisy), at C concurrent streams of N tokens; every prompt has blocks no
other one has (each request stores blocks, and a small cache evicts them), and tokens/s is
compared with the off server's of the same round: the median of those paired ratios is the cost.
--null serves with the null runner (no model: fixed logits at no cost), so the steps are as short
as the serving stack allows and the events' share of them is at its largest.

--in-process measures one engine, in this process, with its events switched on and off between
passes (the same runner, kernels and memory: none of three servers' noise on a shared machine),
a subscriber attached: the step loop's own cost of the events, free of HTTP.

    .venv/bin/python -m load.bench_kv_events [--model-dir models/smollm2-135m-instruct-gptq]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import zmq

from load.local_server import LocalServer, free_port, local_server

PREFIX = "You are a careful assistant. Answer briefly and precisely. " * 4


async def drive(
    server: LocalServer, concurrency: int, tokens: int, requests: int, tag: str
) -> float:
    """`requests` streams of `tokens` tokens, `concurrency` at a time: tokens/s."""
    url = f"{server.base_url}/v1/completions"
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        prompt = f"{PREFIX}Request {tag}-{i}: tell the story of the number {i * 7919}."
        body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        async with limit:
            reply = await client.post(url, json=body)
            reply.raise_for_status()

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(requests)))
        return requests * tokens / (time.perf_counter() - start)


@contextlib.contextmanager
def subscriber(port: int) -> Iterator[dict[str, int]]:
    """A SUB socket on a thread, decoding every batch: counts of batches, events, drops."""
    counts = {"batches": 0, "stored": 0, "removed": 0}
    stop = threading.Event()

    def run() -> None:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        while not stop.is_set():
            if sub.poll(100):
                _, _, payload = sub.recv_multipart()
                _, events, _ = msgpack.unpackb(payload)
                counts["batches"] += 1
                counts["stored"] += sum(e[0] == "BlockStored" for e in events)
                counts["removed"] += sum(e[0] == "BlockRemoved" for e in events)
        sub.close(linger=0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield counts
    finally:
        stop.set()
        thread.join()


def dropped(server: LocalServer) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("predictor_kv_events_dropped_total "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def events_config(port: int) -> list[str]:
    # bound (a `*`: vLLM's rule; tcp://127.0.0.1:PORT would be connected to)
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "topic": "kv@127.0.0.1:0@m"}  # fmt: skip
    return ["--kv-events-config", json.dumps(config), "--prefix-caching-hash-algo", "sha256_cbor"]


def in_process(args: argparse.Namespace) -> None:
    """One engine driven step by step here, its events on and off in alternate passes."""
    from prometheus_client import CollectorRegistry

    from predictor.config import CacheSettings, ModelSettings, SchedulerSettings, Settings
    from predictor.engine_assembly import build_engine
    from predictor.model.loader import load_checkpoint
    from predictor.observability.metrics import Metrics
    from predictor.types import GenerateRequest, SamplingParams

    port = free_port()
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                         "topic": "kv@127.0.0.1:0@m"})  # fmt: skip
    settings = Settings(
        ModelSettings(threads=args.threads),
        scheduler=SchedulerSettings(args.concurrency, max_waiting=4096),
        cache=CacheSettings(
            args.max_cache_tokens, kv_events_config=config, prefix_caching_hash_algo="sha256_cbor"
        ),
    )
    loaded = load_checkpoint(Path(args.model_dir), "cpu", threads=1)
    engine = build_engine(loaded, settings, Metrics(CollectorRegistry(), "bench"))
    loop = engine._loop  # driven here, on this thread: no step loop thread, no asyncio
    loop.runner.bind_thread()
    scheduler, cache = loop.scheduler, loop.scheduler.allocator
    recorder = scheduler.events
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    tokenizer = loaded.tokenizer

    cpu_s: dict[bool, list[float]] = {False: [], True: []}

    def one_pass(tag: str, events: bool) -> float:
        scheduler.events = cache.evictions = recorder if events else None
        requests = []
        for i in range(args.requests):
            ids = tokenizer.encode(f"{PREFIX}Request {tag}-{i}: the story of {i * 7919}.")
            generate = GenerateRequest(f"{tag}-{i}", "", params=params)
            requests.append(engine.inputs.request(generate, list(ids), lambda e: None, None))
        for request in requests:
            scheduler.add(request)
        start, cpu = time.perf_counter(), time.thread_time()
        while scheduler.running or scheduler.waiting():
            loop.step()
        cpu_s[events].append(time.thread_time() - cpu)  # the step loop's own CPU time
        return args.requests * args.tokens / (time.perf_counter() - start)

    with subscriber(port) as counts:
        one_pass("warm", True)
        cpu_s[True].clear()
        speeds: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for events in (False, True) if r % 2 else (True, False):
                speeds[events].append(one_pass(f"{r}-{events}", events))
        time.sleep(0.5)
    engine.stop()
    ratios = [on / off for on, off in zip(speeds[True], speeds[False], strict=True)]
    print(f"in process: C={args.concurrency}, {args.requests} requests of {args.tokens} tokens, "
          f"{args.rounds} rounds, {args.threads} thread(s), {args.model_dir}")  # fmt: skip
    print(f"off tokens/s: {' / '.join(f'{s:.1f}' for s in speeds[False])}")
    print(f"on tokens/s:  {' / '.join(f'{s:.1f}' for s in speeds[True])}")
    print(f"on / off per round: {' / '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f}")  # fmt: skip
    # CPU seconds the step loop spent per pass: what the events cost it, whatever else runs
    cpu = [on / off for on, off in zip(cpu_s[True], cpu_s[False], strict=True)]
    print(f"step loop CPU s, off: {' / '.join(f'{x:.2f}' for x in cpu_s[False])}")
    print(f"step loop CPU s, on:  {' / '.join(f'{x:.2f}' for x in cpu_s[True])}")
    print(f"CPU on / off per round: {' / '.join(f'{x:.3f}' for x in cpu)}; "
          f"median {statistics.median(cpu):.3f}")  # fmt: skip
    print(f"subscriber: {counts['batches']} batches, {counts['stored']} BlockStored, "
          f"{counts['removed']} BlockRemoved")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="models/smollm2-135m-instruct-gptq")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-cache-tokens", type=int, default=4096, help="small: evictions")
    parser.add_argument("--null", action="store_true", help="the null runner: no model")
    parser.add_argument("--in-process", action="store_true", help="one engine, events toggled")
    args = parser.parse_args()
    if args.in_process:
        in_process(args)
        return
    common = ["--threads", str(args.threads), "--max-batch-size", str(args.concurrency),
              "--max-cache-tokens", str(args.max_cache_tokens)]  # fmt: skip
    if args.null:
        common += ["--runner", "null"]
    watched, unwatched = free_port(), free_port()
    configs = {"off": [], "on, subscribed": events_config(watched),
               "on, no subscriber": events_config(unwatched)}  # fmt: skip
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, extra in configs.items():
            log = Path(tempfile.mkstemp(prefix="bench-kv-events-", suffix=".log")[1])
            servers[name] = stack.enter_context(
                local_server(args.model_dir, "m", log, [*common, *extra])
            )
        counts = stack.enter_context(subscriber(watched))
        for name, server in servers.items():  # warm: first requests, autotune'd kernels settle
            asyncio.run(drive(server, args.concurrency, 8, args.concurrency, f"warm-{name}"))
        rounds: dict[str, list[float]] = {name: [] for name in servers}
        for r in range(args.rounds):
            order = list(servers.items())
            if r % 2:  # alternate which server goes first
                order.reverse()
            for name, server in order:
                speed = asyncio.run(
                    drive(server, args.concurrency, args.tokens, args.requests, f"{r}-{name}")
                )
                rounds[name].append(speed)
        lost = {name: dropped(server) for name, server in servers.items()}
        time.sleep(0.5)  # the last batches reach the subscriber
    off = rounds["off"]
    runner = ", null runner" if args.null else ""
    print(f"C={args.concurrency}, {args.requests} requests of {args.tokens} tokens, "
          f"{args.rounds} rounds, {args.threads} thread(s), "
          f"--max-cache-tokens {args.max_cache_tokens}{runner}")  # fmt: skip
    print("| KV events | tokens/s per round | vs off, per round | median ratio |")
    print("|---|---|---|---|")
    for name, runs in rounds.items():
        ratios = [r / o for r, o in zip(runs, off, strict=True)]
        speeds = " / ".join(f"{s:.1f}" for s in runs)
        paired = " / ".join(f"{x:.3f}" for x in ratios)
        print(f"| {name} | {speeds} | {paired} | {statistics.median(ratios):.3f} |")
    print(f"subscriber: {counts['batches']} batches, {counts['stored']} BlockStored, "
          f"{counts['removed']} BlockRemoved; dropped: "
          f"{', '.join(f'{k} {v:.0f}' for k, v in lost.items())}")  # fmt: skip


if __name__ == "__main__":
    main()
