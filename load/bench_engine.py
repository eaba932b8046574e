"""Engine benchmark (a script, not a test): continuous batching vs sequential `generate`.

In process, on the default GPTQ model: aggregate tokens/s at concurrency 1, 4 and 16, each as a
ratio to sequential transformers `generate` measured in the same run; then time to first token
p50/p95 with requests arriving at random (Poisson). Every request generates exactly
--new-tokens tokens (end-of-sequence is ignored) so the two sides do the same work.

    .venv/bin/python load/bench_engine.py [--model-dir models/smollm2-135m-instruct-gptq]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = Path(__file__).with_name("prompts.txt")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/smollm2-135m-instruct-gptq"))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--sequential-requests", type=int, default=4)
    parser.add_argument("--poisson-requests", type=int, default=32)
    parser.add_argument(
        "--poisson-rate", type=float, default=0.0, help="req/s (0: 60%% of capacity)"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--null",
        action="store_true",
        help="no model: a null runner returns logits at no cost; measures the engine alone",
    )
    parser.add_argument("--null-batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--null-steps", type=int, default=200)
    return parser.parse_args()


def null_main(args: argparse.Namespace) -> None:
    """The engine's own cost: scheduler, step loop, sampling, detokenizer, asyncio consumers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from predictor.engine.async_engine import AsyncEngine
    from predictor.engine.kv_cache import BlockAllocator
    from predictor.engine.runners.null import NullRunner
    from predictor.engine.scheduler import Scheduler
    from predictor.engine.step_loop import StepLoop
    from predictor.types import GenerateRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    prompts = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    print(f"null runner, tokenizer of {args.model_dir}, {args.null_steps} tokens per request")
    print(f"{'batch':>6} {'tok/s':>9} {'engine ms/step':>15} {'us/row':>7}")
    for batch in args.null_batches:
        steps: list[float] = []
        allocator = BlockAllocator(1 << 16, 16)
        runner = NullRunner(len(tok), allocator.num_blocks, allocator.block_size, batch)
        scheduler = Scheduler(batch, batch, allocator, max_step_tokens=max(4096, 2 * batch))
        loop = StepLoop(runner, scheduler, frozenset())
        engine = AsyncEngine(
            loop, tok, max_tokens_limit=4096, max_prompt_tokens=4096,
            on_step=lambda stats, out=steps: out.append(time.perf_counter()),
        )  # fmt: skip
        params = SamplingParams(max_tokens=args.null_steps, ignore_eos=True)

        async def one(i: int, eng: AsyncEngine = engine, p: SamplingParams = params) -> int:
            req = GenerateRequest(f"n{i}", prompts[i % len(prompts)], p)
            count = 0
            async for event in eng.generate(req):
                count += len(event.token_ids)
            return count

        async def run(n: int = batch) -> tuple[int, float]:
            started = time.perf_counter()
            counts = await asyncio.gather(*(one(i) for i in range(n)))
            return sum(counts), time.perf_counter() - started

        engine.start()
        try:
            tokens, seconds = asyncio.run(run())
        finally:
            engine.stop()
        gaps = sorted(b - a for a, b in zip(steps[1:], steps[2:], strict=False))
        per_step = statistics.median(gaps) if gaps else float("nan")
        print(
            f"{batch:>6} {tokens / seconds:9.0f} {per_step * 1000:15.2f} "
            f"{per_step / batch * 1e6:7.1f}"
        )


def main() -> None:
    args = parse_args()
    if args.null:
        null_main(args)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from prometheus_client import CollectorRegistry

    from predictor.config import ModelSettings, SchedulerSettings, Settings
    from predictor.engine.async_engine import AsyncEngine
    from predictor.engine_assembly import build_engine
    from predictor.model.loader import load_checkpoint
    from predictor.observability.metrics import Metrics
    from predictor.types import GenerateRequest, SamplingParams

    # As the server does: one torch thread on the main thread; parallel torch work only on the
    # worker threads (see ModelRunner.bind_thread), the baseline's as well as the engine's.
    loaded = load_checkpoint(args.model_dir, args.device, threads=1)
    print(f"model {args.model_dir} on {loaded.device}, kernel {loaded.kernel}, "
          f"{args.threads} threads, {args.new_tokens} new tokens per request")  # fmt: skip
    prompts = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    tok = loaded.tokenizer

    def chat_ids(prompt: str) -> list[int]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(tok.encode(text, add_special_tokens=False))

    def generate(prompt: str, new_tokens: int) -> None:
        ids = torch.tensor([chat_ids(prompt)], device=loaded.device)
        with torch.inference_mode():
            loaded.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=loaded.pad_token_id,
            )  # fmt: skip

    def sequential_generate() -> float:
        torch.set_num_threads(args.threads)
        generate(prompts[0], 4)  # warm-up: the first forward transforms the GPTQ weights
        started = time.perf_counter()
        for prompt in prompts[: args.sequential_requests]:
            generate(prompt, args.new_tokens)
        return args.sequential_requests * args.new_tokens / (time.perf_counter() - started)

    sequential = 0.0  # --sequential-requests 0: the engine's batch sizes only, no ratios
    if args.sequential_requests > 0:
        with ThreadPoolExecutor(1) as pool:
            sequential = pool.submit(sequential_generate).result()
        print(f"\nsequential generate: {sequential:7.1f} tok/s (batch 1)")

    def engine() -> AsyncEngine:
        # a checkpoint of its own: the server's engine empties the model's 4-bit modules once
        # its runner has fused them (release_model_weights), so a second engine cannot share it
        settings = Settings(
            ModelSettings(threads=args.threads), scheduler=SchedulerSettings(64, max_waiting=1024)
        )
        own = load_checkpoint(args.model_dir, args.device, threads=1)
        return build_engine(own, settings, Metrics(CollectorRegistry(), "bench"))

    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)

    async def one(eng: AsyncEngine, i: int, arrive: float = 0.0) -> tuple[float, int]:
        await asyncio.sleep(arrive)
        req = GenerateRequest(f"b{i}", prompts[i % len(prompts)], params, chat=True)
        sent, first, count = time.perf_counter(), 0.0, 0
        async for event in eng.generate(req):
            if event.token_ids and not first:
                first = time.perf_counter() - sent
            count += len(event.token_ids)
        return first, count

    async def concurrency_run(c: int) -> float:
        eng = engine()
        eng.start()
        try:
            started = time.perf_counter()
            results = await asyncio.gather(*(one(eng, i) for i in range(c)))
            return sum(n for _, n in results) / (time.perf_counter() - started)
        finally:
            eng.stop()

    print(f"\n{'concurrency':>11} {'tok/s':>8} {'x sequential':>13}")
    rates = {}
    for c in args.concurrency:
        rates[c] = asyncio.run(concurrency_run(c))
        ratio = f"{rates[c] / sequential:12.2f}x" if sequential else f"{'-':>13}"
        print(f"{c:>11} {rates[c]:8.1f} {ratio}")

    if args.poisson_requests <= 0:  # --poisson-requests 0: the batch sizes only
        return
    capacity = max(rates.values()) / args.new_tokens  # requests/s at the best batch size
    rate = args.poisson_rate or 0.6 * capacity
    rng = random.Random(7)
    arrivals, t = [], 0.0
    for _ in range(args.poisson_requests):
        t += rng.expovariate(rate)
        arrivals.append(t)

    async def poisson_run() -> list[float]:
        eng = engine()
        eng.start()
        try:
            results = await asyncio.gather(
                *(one(eng, i, arrive) for i, arrive in enumerate(arrivals))
            )
            return [first for first, _ in results]
        finally:
            eng.stop()

    ttfts = sorted(asyncio.run(poisson_run()))
    p50 = statistics.median(ttfts)
    p95 = ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))]
    print(
        f"\nPoisson arrivals: {len(ttfts)} requests at {rate:.2f} req/s: "
        f"TTFT p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
