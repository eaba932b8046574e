"""The cost of determinism (a script, not a test): tokens/s at C=1 and C=16 and a long prompt's
time to first token, the engine as it was before determinism became the default (the fastest
kernel per row count, prompt chunks through torch's SDPA) against today's default (one
row-invariant kernel a matmul, every token through the decode attention kernel), speculation on
in both, interleaved in one run on the default model, the order alternating round by round,
every prompt new to both servers (a repeat would draft from its own answer); the median of
the rounds' paired ratios; and how many of 16 requests differ alone and batched.

    .venv/bin/python -m load.bench_invariance [--model-dir models/smollm2-135m-instruct-gptq]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "went", "home", "to", "sleep"]


def engine(model_dir: Path, invariant: bool, threads: int) -> Any:
    from prometheus_client import CollectorRegistry

    from predictor.config import ModelSettings, SchedulerSettings, Settings
    from predictor.engine_assembly import build_engine
    from predictor.model.loader import load_checkpoint
    from predictor.observability.metrics import Metrics

    loaded = load_checkpoint(model_dir, device="cpu", threads=1)
    settings = Settings(
        ModelSettings(threads=threads, autotune_cache=""), scheduler=SchedulerSettings(16)
    )
    made = build_engine(
        loaded, settings, Metrics(CollectorRegistry(), "bench"), invariant=invariant
    )
    made.start()
    while not made.ready():
        time.sleep(0.05)
    return made


async def tokens(made: Any, prompt: str, params: Any, rid: str) -> list[int]:
    from predictor.types import GenerateRequest

    out: list[int] = []
    async for event in made.generate(GenerateRequest(rid, prompt, params)):
        out.extend(event.token_ids)
    return out


async def rate(made: Any, concurrency: int, tag: str, waves: int = 1) -> float:
    """Tokens/s of `waves` waves of `concurrency` requests at once, each prompt new (with
    speculation on, how much a text drafts depends on the text: C=1 runs several prompts in
    turn, so that one text's repetitiveness does not decide the figure)."""
    from predictor.types import SamplingParams

    params = SamplingParams(max_tokens=96, ignore_eos=True)
    started, made_tokens = time.perf_counter(), 0
    for wave in range(waves):
        runs = [tokens(made, f"Tell me about {tag} item {wave}-{i}.", params, f"r{wave}-{i}")
                for i in range(concurrency)]  # fmt: skip
        made_tokens += sum(len(t) for t in await asyncio.gather(*runs))
    return made_tokens / (time.perf_counter() - started)


async def first_token(made: Any, words: int) -> float:
    from predictor.types import SamplingParams

    prompt = f"{time.time()} " + " ".join(["word"] * words)  # a new prompt: no cached prefix
    started = time.perf_counter()
    await tokens(made, prompt, SamplingParams(max_tokens=1), "long")
    return time.perf_counter() - started


async def differing(made: Any) -> tuple[int, int]:
    from predictor.types import SamplingParams

    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80))) for _ in range(16)]
    found = []
    for seeded in (False, True):

        def params(i: int, seeded: bool = seeded) -> Any:
            return SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8 if seeded else 0,
                                  seed=i if seeded else None)  # fmt: skip

        alone = [await tokens(made, p, params(i), f"a{i}") for i, p in enumerate(prompts)]
        batched = await asyncio.gather(
            *(tokens(made, p, params(i), f"b{i}") for i, p in enumerate(prompts))
        )
        found.append(sum(a != b for a, b in zip(alone, batched, strict=True)))
    return found[0], found[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/smollm2-135m-instruct-gptq"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--long-prompt", type=int, default=1500)
    args = parser.parse_args()
    engines = {mode: engine(args.model_dir, mode, args.threads) for mode in (False, True)}
    ratios: dict[str, list[float]] = {"C=1": [], "C=16": [], "ttft": []}
    figures: dict[tuple[str, bool], list[float]] = {}
    try:
        for round_ in range(args.rounds):
            order = [False, True] if round_ % 2 == 0 else [True, False]
            got: dict[tuple[str, bool], float] = {}
            for mode in order:
                made = engines[mode]
                for concurrency in (1, 16):
                    tag = f"{WORDS[round_ % len(WORDS)]}-{round_}-{int(mode)}-{concurrency}"
                    waves = 8 if concurrency == 1 else 1
                    got[f"C={concurrency}", mode] = asyncio.run(rate(made, concurrency, tag, waves))
                got["ttft", mode] = asyncio.run(first_token(made, args.long_prompt))
            for key in ratios:
                ratios[key].append(got[key, True] / got[key, False])
                for mode in (False, True):
                    figures.setdefault((key, mode), []).append(got[key, mode])
        differ = {mode: asyncio.run(differing(made)) for mode, made in engines.items()}
    finally:
        for made in engines.values():
            made.stop()
    for key, paired in ratios.items():
        unit = "s" if key == "ttft" else "tok/s"
        before, now = statistics.median(figures[key, False]), statistics.median(figures[key, True])
        print(
            f"{key}: before {before:.2f} {unit}, deterministic {now:.2f} {unit}; median paired "
            f"ratio {statistics.median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})"
        )
    for mode, (greedy, seeded) in differ.items():
        name = "deterministic" if mode else "before"
        print(f"{name}: of 16 requests, {greedy} greedy and {seeded} seeded differ alone/batched")


if __name__ == "__main__":
    main()
