"""LoRA adapters served, the three figures of issue 47 in one run, one server:

- C=16: 16 streams of 4 rank-16 adapters and the base model mixed, against 16 of the base model;
- C=1: a rank-16 adapter's requests one after another, against the base model's (taking turns
  request by request);
- `--loads` adapters loaded at run time (POST /v1/load_lora_adapter), one a second, while 8 streams
  run: the longest gap between two tokens of a stream that began during each load (the stream's
  previous token came after the load was asked for), against the median gap, beside the longest
  in a window as long just before it (the machine's own jitter: the client and the server share
  its cores), and how many gaps were over 2x the median in each kind of window.

    python -m load.bench_lora [--rounds 3] [--threads 1] [--loads 6]

Adapters: random factors on every projection (load/random_lora.py), the default model,
`--speculative off` (drafts would make the comparison one of acceptance), greedy, `ignore_eos`,
64 tokens per request, OpenAI completions streamed over SSE. Each comparison alternates the two
sides `--rounds` times and reports the median tokens/s of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from load.local_server import local_server
from load.random_lora import write_adapter
from predictor.engine.runners.native.bindings import cpu_model

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [line for line in (REPO / "load" / "prompts.txt").read_text().splitlines() if line]


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                 tokens: int) -> list[float]:  # fmt: skip
    """One streamed completion: the arrival time of each of its text events."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            data = line[6:] if line.startswith("data: ") else "[DONE]"
            if data != "[DONE]" and json.loads(data)["choices"]:
                times.append(time.perf_counter())
    return times


async def level(url: str, models: list[str], tokens: int) -> float:
    """Requests for `models` at once; tokens/s over the level."""
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        done = await asyncio.gather(*(
            stream(client, url, m, PROMPTS[i % len(PROMPTS)], tokens)
            for i, m in enumerate(models)
        ))  # fmt: skip
    return sum(len(t) for t in done) / (time.perf_counter() - started)


async def one_by_one(url: str, models: list[str], count: int, tokens: int) -> list[float]:
    """`count` requests of each model, one at a time, the models taking turns request by
    request (the same prompt in a turn: a drift of the machine's speed falls on each alike):
    each model's tokens/s."""
    total, seconds = [0] * len(models), [0.0] * len(models)
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(count):
            for j, model in enumerate(models):
                started = time.perf_counter()
                prompt = PROMPTS[i % len(PROMPTS)]
                total[j] += len(await stream(client, url, model, prompt, tokens))
                seconds[j] += time.perf_counter() - started
    return [t / s for t, s in zip(total, seconds, strict=True)]


async def load_during_streams(
    url: str, paths: list[Path], streams: int
) -> tuple[list[tuple[float, float, float, float]], tuple[int, int, int, int]]:
    """Adapters loaded one after another while `streams` streams run: per load, (the longest gap
    between two tokens of a stream that began during the load, the same in a window as long
    just before it with no load: the machine's own jitter, the median gap, the seconds the
    load took); and over all loads, (the gaps that began during one, how many of them were
    over 2x the median, the same two in the windows before)."""
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream(client, url, "base", PROMPTS[i % len(PROMPTS)],
                                            70 * (len(paths) + 1)))
                 for i in range(streams)]  # fmt: skip
        await asyncio.sleep(1.5)
        windows = []
        for i, path in enumerate(paths):
            began = time.perf_counter()
            body = {"lora_name": f"late{i}", "lora_path": str(path)}
            r = await client.post(f"{url}/v1/load_lora_adapter", json=body)
            ended = time.perf_counter()
            r.raise_for_status()
            windows.append((began, ended))
            await asyncio.sleep(1.0)
        runs = await asyncio.gather(*tasks)
    gaps = [(after - before, before, after) for times in runs
            for before, after in zip(times, times[1:], strict=False)]  # fmt: skip
    median = statistics.median(g for g, _, _ in gaps)

    def longest(start: float, end: float) -> float:
        """The longest gap whose next token was due in [start, end]: its stream's previous
        token came in that window (a gap already running when the load was asked for is the
        machine's, not the load's)."""
        return max((g for g, before, _ in gaps if start <= before <= end), default=0.0)

    def over(spans: list[tuple[float, float]]) -> tuple[int, int]:
        inside = [g for g, before, _ in gaps if any(a <= before <= b for a, b in spans)]
        return len(inside), sum(g > 2 * median for g in inside)

    loads = [(longest(began, ended), longest(2 * began - ended, began), median, ended - began)
             for began, ended in windows]  # fmt: skip
    quiet = [(2 * began - ended, began) for began, ended in windows]
    return loads, (*over(windows), *over(quiet))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir", type=Path, default=REPO / "models/smollm2-135m-instruct-gptq"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--loads", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        names = [f"a{i}" for i in range(4)]
        for i, name in enumerate(names):
            write_adapter(root / name, args.model_dir, 16, i, std=0.02)
        late = [write_adapter(root / f"late{i}", args.model_dir, 16, 9 + i, std=0.02)
                for i in range(args.loads)]  # fmt: skip
        extra = ["--threads", str(args.threads), "--max-batch-size", "16", "--speculative", "off",
                 "--allow-runtime-lora", "true", "--lora-modules",
                 *(f"{n}={root / n}" for n in names)]  # fmt: skip
        log = root / "server.log"
        with local_server(str(args.model_dir), "base", log, extra=extra) as server:
            url = server.base_url
            asyncio.run(level(url, ["base", *names], 8))  # warm every path
            base16, mixed16, base1, lora1 = [], [], [], []
            for _ in range(args.rounds):
                base16.append(asyncio.run(level(url, ["base"] * 16, args.tokens)))
                mixed16.append(asyncio.run(level(url, (["base", *names] * 4)[:16], args.tokens)))
                pair = asyncio.run(one_by_one(url, ["base", "a0"], 4, args.tokens))
                base1.append(pair[0])
                lora1.append(pair[1])
            loads, counts = asyncio.run(load_during_streams(url, late, 8))
        # the LoRA kernel's modes, as the server's autotune chose them (lora_tune.py)
        plan = [line.split("kernel lora: ", 1)[1] for line in log.read_text().splitlines()
                if "kernel lora: " in line]  # fmt: skip
    b16, m16 = statistics.median(base16), statistics.median(mixed16)
    b1, l1 = statistics.median(base1), statistics.median(lora1)
    kernel = plan[-1] if plan else "torch"
    print(f"CPU: {cpu_model()}; {args.threads} thread(s); {args.tokens} tokens a request; "
          f"median of {args.rounds} rounds; LoRA kernel: {kernel}")  # fmt: skip
    print("| figure | base model | with adapters | ratio | goal |")
    print("|---|---|---|---|---|")
    print(f"| C=16, 4 adapters + base mixed | {b16:.1f} tok/s | {m16:.1f} tok/s | "
          f"{m16 / b16:.2f}x | >= 0.8x |")  # fmt: skip
    print(f"| C=1, a rank-16 adapter | {b1:.1f} tok/s | {l1:.1f} tok/s | {l1 / b1:.2f}x | "
          ">= 0.9x |")  # fmt: skip
    for gap, quiet, median, seconds in loads:
        print(f"| loading an adapter ({seconds:.2f} s) under 8 streams | median gap "
              f"{median * 1e3:.1f} ms; longest {quiet * 1e3:.1f} ms ({quiet / median:.2f}x) "
              f"just before, with no load | longest gap during the load {gap * 1e3:.1f} ms | "
              f"{gap / median:.2f}x | <= 2x |")  # fmt: skip
    during, slow, before, slow_before = counts
    print(f"gaps over 2x the median: {slow} of {during} that began during a load, "
          f"{slow_before} of {before} in the windows just before (no load)")  # fmt: skip


if __name__ == "__main__":
    main()
