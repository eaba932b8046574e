"""Grammar benchmark (a script, not a test): the cost of constrained decoding.

On the default GPTQ model, in process: a typical JSON schema's and a typical tool set's compile
time (cold, median of several), then aggregate tokens/s at concurrency C with a JSON schema on
every row, and with tools (`tool_choice` auto: free text where a call must validate; required:
calls only), against the same requests unconstrained, alternating in one run so all see the
same machine.

    .venv/bin/python load/bench_grammar.py [--model-dir ...] [--threads 1] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

PROMPTS = Path(__file__).with_name("prompts.txt")

TYPICAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "role", "address"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}},
    {"name": "create_user", "parameters": TYPICAL},
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/smollm2-135m-instruct-gptq"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from prometheus_client import CollectorRegistry

    from predictor.config import ModelSettings, SchedulerSettings, Settings
    from predictor.engine import tool_calls
    from predictor.engine.grammar import Grammars
    from predictor.engine_assembly import build_engine
    from predictor.model.loader import load_checkpoint
    from predictor.observability.metrics import Metrics
    from predictor.types import GenerateRequest, Grammar, SamplingParams

    loaded = load_checkpoint(args.model_dir, "cpu", threads=1)
    prompts = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    started = time.perf_counter()
    grammars = Grammars(loaded.tokenizer, loaded.eos_ids)
    print(f"tokenizer info: {(time.perf_counter() - started) * 1000:.0f} ms (once per server)")
    kinds = {
        "typical": Grammar("json_schema", json.dumps(TYPICAL)),
        "tools auto": Grammar("structural_tag", tool_calls.structural_tag(TOOLS, "auto", True)),
        "tools required": Grammar(
            "structural_tag", tool_calls.structural_tag(TOOLS, "required", True)
        ),
    }
    for name, grammar in kinds.items():
        times = []
        for _ in range(7):
            fresh = Grammars.__new__(Grammars)
            fresh.__dict__.update(grammars.__dict__)
            fresh._cache = type(grammars._cache)()  # cold: an empty cache
            started = time.perf_counter()
            fresh.compile(grammar)
            times.append(time.perf_counter() - started)
        print(f"{name} compile: median {statistics.median(times) * 1000:.1f} ms, "
              f"max {max(times) * 1000:.1f} ms")  # fmt: skip

    settings = Settings(
        ModelSettings(threads=args.threads), scheduler=SchedulerSettings(64, max_waiting=1024)
    )
    engine = build_engine(loaded, settings, Metrics(CollectorRegistry(), "bench"))

    async def wave(grammar: Grammar | None) -> tuple[float, int]:
        # ignore_eos holds every row to the budget; a grammar's own end is not delayed by it
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.8, seed=1,
                                ignore_eos=True, grammar=grammar)  # fmt: skip

        async def one(i: int) -> int:
            req = GenerateRequest(f"g{i}", prompts[i % len(prompts)], params, chat=True)
            return sum([len(e.token_ids) async for e in engine.generate(req)])

        begun = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(args.concurrency)))
        return sum(counts) / (time.perf_counter() - begun), sum(counts)

    engine.start()
    try:
        asyncio.run(wave(None))  # warm-up
        for grammar in kinds.values():
            asyncio.run(wave(grammar))
        # the constrained answers outlast the token budget (a random call may end early: the
        # token counts printed say so), so the rates compare like for like
        rates: dict[str, list[float]] = {"unconstrained": [], **{name: [] for name in kinds}}
        for _ in range(args.rounds):
            for name, grammar in (("unconstrained", None), *kinds.items()):
                rate, tokens = asyncio.run(wave(grammar))
                rates[name].append(rate)
                print(f"  {name:>14}: {rate:7.1f} tok/s ({tokens} tokens)")
    finally:
        engine.stop()
    base = statistics.median(rates["unconstrained"])
    print(f"\nC={args.concurrency}, {args.threads} thread(s), median of {args.rounds}:")
    for name, values in rates.items():
        print(f"{name:>14}: {statistics.median(values):7.1f} tok/s "
              f"({statistics.median(values) / base:.2f}x unconstrained)")  # fmt: skip
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
