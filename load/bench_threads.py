"""Threads benchmark (a script, not a test): the engine at 1 and at 2 threads, side by side.

On the default GPTQ model, each thread count in its own process (the kernels and the attention
take `--threads` when the runner is built), alternating over --rounds so the machine's noise hits
both alike: aggregate tokens/s at each concurrency, greedy, `ignore_eos`, --new-tokens a row.

    .venv/bin/python load/bench_threads.py [--threads 1 2] [--concurrency 1 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = Path(__file__).with_name("prompts.txt")


def measure(model_dir: Path, threads: int, levels: list[int], new_tokens: int) -> dict[int, float]:
    """In this process: tok/s at each concurrency with an engine of `threads` threads."""
    from prometheus_client import CollectorRegistry

    from predictor.config import ModelSettings, SchedulerSettings, Settings
    from predictor.engine_assembly import build_engine
    from predictor.model.loader import load_checkpoint
    from predictor.observability.metrics import Metrics
    from predictor.types import GenerateRequest, SamplingParams

    loaded = load_checkpoint(model_dir, "cpu", threads=threads)
    settings = Settings(
        ModelSettings(threads=threads), scheduler=SchedulerSettings(64, max_waiting=1024)
    )
    engine = build_engine(loaded, settings, Metrics(CollectorRegistry(), "bench"))
    prompts = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

    async def wave(c: int) -> float:
        async def one(i: int) -> int:
            req = GenerateRequest(f"t{i}", prompts[i % len(prompts)], params, chat=True)
            return sum([len(e.token_ids) async for e in engine.generate(req)])

        begun = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(c)))
        return sum(counts) / (time.perf_counter() - begun)

    engine.start()
    try:
        asyncio.run(wave(max(levels)))  # warm-up
        return {c: statistics.median(asyncio.run(wave(c)) for _ in range(2)) for c in levels}
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/smollm2-135m-instruct-gptq"))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child is not None:
        rates = measure(args.model_dir, args.child, args.concurrency, args.new_tokens)
        print(json.dumps(rates))
        return
    results: dict[int, dict[int, list[float]]] = {t: {} for t in args.threads}
    for round_ in range(args.rounds):
        for threads in args.threads if round_ % 2 == 0 else args.threads[::-1]:
            command = [sys.executable, __file__, "--child", str(threads), "--model-dir",
                       str(args.model_dir), "--new-tokens", str(args.new_tokens),
                       "--concurrency", *map(str, args.concurrency)]  # fmt: skip
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            rates = json.loads(out.stdout.strip().splitlines()[-1])
            shown = ", ".join(f"C={c} {r:.1f} tok/s" for c, r in rates.items())
            print(f"round {round_ + 1}, {threads} thread(s): {shown}", flush=True)
            for c, r in rates.items():
                results[threads].setdefault(int(c), []).append(r)
    base = args.threads[0]
    print(f"\nmedian of {args.rounds} rounds; load average {os.getloadavg()}")
    for threads in args.threads:
        print(f"{threads} thread(s): " + ", ".join(
            f"C={c} {statistics.median(v):.1f} tok/s "
            f"({statistics.median(v) / statistics.median(results[base][c]):.2f}x)"
            for c, v in results[threads].items()))  # fmt: skip


if __name__ == "__main__":
    main()
