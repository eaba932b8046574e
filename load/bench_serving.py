"""Serving benchmark (asyncio, no locust): TTFT, inter-token latency and tokens/s at several
concurrency levels against any OIP `generate_stream` endpoint (--api oip) or any OpenAI
streaming chat completions endpoint (--api openai: `{url}{--openai-prefix}/chat/completions`),
and the C=16 / C=1 ratio. Both send each prompt as one user message through the chat template;
--ignore-eos asks for exactly --max-tokens tokens per request (both protocols take `ignore_eos`).
--null starts the server with the null runner (no model): what REST, SSE and the engine cost.

With --url it measures that server; without, it starts `python -m predictor` on the default
model. --infer-check also times 16 concurrent V2 infer requests against one.

--workload shared-prefix sends one long common document (load/document.txt, ~1,600 tokens)
before a different question each time, as RAG and chat clients do, and reports the prefix-cache
hit rate beside TTFT and tokens/s: from the responses' cached-token counts
(`usage.prompt_tokens_details.cached_tokens`, OIP `details.cached_tokens`) where the server
reports them, else from its /metrics counters (ours, vLLM's), else "-". It runs against any
OpenAI-compatible server (vLLM, llama.cpp's llama-server: --url ... --api openai). One request
with the document goes first, so every level measures the warm steady state.

    .venv/bin/python -m load.bench_serving [--url http://127.0.0.1:8080 --model NAME] [--api openai]
        [--workload shared-prefix --concurrency 1 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from load.local_server import REPO, local_server

PROMPTS = [p for p in (REPO / "load" / "prompts.txt").read_text().splitlines() if p.strip()]
DOCUMENT = (REPO / "load" / "document.txt").read_text()
QUESTIONS = (
    "What does this project serve?", "Which protocols does it speak?",
    "How is the model quantized?", "What does make run do?", "How are streams cancelled?",
    "Which gRPC service is used?", "What is the default model?", "How is it deployed?",
    "What does the engine batch?", "Where do metrics come from?", "What is a block?",
    "How do tests run?", "What limits a request?", "Which clients are supported?",
    "What happens on overload?", "Summarize the text in one sentence.",
)  # fmt: skip


def shared_prefix_prompts(count: int, offset: int = 0, document: str = DOCUMENT) -> list[str]:
    """`count` prompts: the document, then a question no other of them asks."""
    return [
        f"{document}\nQuestion {offset + i + 1}: {QUESTIONS[(offset + i) % len(QUESTIONS)]}"
        for i in range(count)
    ]


# a null-runner server sized for 256 streams of up to 512 tokens
NULL_SERVER_ARGS = (
    "--runner", "null", "--max-batch-size", "256", "--max-waiting", "512",
    "--max-step-tokens", "8192", "--max-cache-tokens", "262144",
)  # fmt: skip


@dataclass
class Sample:
    ttft: float
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    total: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not say


@dataclass(frozen=True)
class Api:
    """How one protocol asks for a stream and reports its text and token count."""

    name: str
    model: str
    openai_prefix: str = "/v1"
    ignore_eos: bool = False
    # a system message naming each request uniquely (OpenAI; OIP: a first line), so that no
    # two prompts share a KV block, not even the chat template's default system prompt: what a
    # prefix cache costs when nothing hits
    unique: bool = False

    def url(self, base: str) -> str:
        if self.name == "openai":
            return f"{base}{self.openai_prefix}/chat/completions"
        return f"{base}/v2/models/{self.model}/generate_stream"

    def body(self, prompt: str, max_tokens: int) -> dict:
        extra = {"ignore_eos": True} if self.ignore_eos else {}
        nonce = f"Session {uuid.uuid4().hex}." if self.unique else ""
        if self.name == "openai":
            messages = [{"role": "user", "content": prompt}]
            if nonce:
                messages.insert(0, {"role": "system", "content": nonce + " Answer briefly."})
            return {
                "model": self.model, "messages": messages,
                "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **extra,
            }  # fmt: skip
        parameters = {"max_tokens": max_tokens, "chat": True, **extra}
        return {"text_input": f"{nonce}\n{prompt}" if nonce else prompt, "parameters": parameters}

    def read(self, event: dict) -> tuple[str, int | None]:
        """The event's new text, and the generated token count when the event reports it."""
        if self.name == "openai":
            usage = event.get("usage")
            text = "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
            return text, usage["completion_tokens"] if usage else None
        details = event.get("details")
        return event.get("text_output", ""), details["generated_tokens"] if details else None

    def prompt_usage(self, event: dict) -> tuple[int, int | None] | None:
        """(prompt tokens, of them cached or None) when the event reports usage."""
        if self.name == "openai":
            usage = event.get("usage")
            if not usage:
                return None
            details = usage.get("prompt_tokens_details") or {}
            return usage.get("prompt_tokens", 0), details.get("cached_tokens")
        details = event.get("details")
        return (details["prompt_tokens"], details.get("cached_tokens")) if details else None


async def one_stream(
    client: httpx.AsyncClient, api: Api, url: str, prompt: str, max_tokens: int
) -> Sample:
    sent = time.perf_counter()
    sample, last = Sample(ttft=0.0), sent
    async with client.stream("POST", url, json=api.body(prompt, max_tokens)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now, event = time.perf_counter(), json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            text, tokens = api.read(event)
            if text:
                if not sample.ttft:
                    sample.ttft = now - sent
                else:
                    sample.gaps.append(now - last)
                last = now
            if tokens is not None:
                sample.tokens = tokens
            usage = api.prompt_usage(event)
            if usage is not None:
                sample.prompt_tokens, sample.cached_tokens = usage
    sample.total = time.perf_counter() - sent
    return sample


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def level(
    client: httpx.AsyncClient,
    api: Api,
    url: str,
    c: int,
    rounds: int,
    max_tokens: int,
    prompts: list[str] | None = None,
) -> dict:
    """C requests at once, `rounds` times, taking `prompts` (default: prompts.txt) in turn."""
    pool = prompts or PROMPTS
    samples: list[Sample] = []
    started = time.perf_counter()
    for r in range(rounds):
        batch = [pool[(r * c + i) % len(pool)] for i in range(c)]
        samples += await asyncio.gather(
            *(one_stream(client, api, url, p, max_tokens) for p in batch)
        )
    wall = time.perf_counter() - started
    gaps = [g for s in samples for g in s.gaps]
    reported = [s for s in samples if s.cached_tokens is not None]
    prompt_tokens = sum(s.prompt_tokens for s in reported)
    return {
        "hit_rate": sum(s.cached_tokens or 0 for s in reported) / prompt_tokens
        if reported and prompt_tokens
        else None,
        "prompt_tokens": sum(s.prompt_tokens for s in samples),
        "c": c,
        "requests": len(samples),
        "ttft_p50": statistics.median(s.ttft for s in samples),
        "ttft_p95": percentile([s.ttft for s in samples], 0.95),
        "itl_p50": statistics.median(gaps) if gaps else 0.0,
        "itl_p95": percentile(gaps, 0.95),
        "tokens": sum(s.tokens for s in samples),
        "tok_s": sum(s.tokens for s in samples) / wall,
    }


async def infer_check(client: httpx.AsyncClient, base: str, model: str, max_tokens: int) -> None:
    url = f"{base}/v2/models/{model}/infer"

    async def infer(prompt: str) -> None:
        tensor = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [prompt]}
        params = {"max_tokens": max_tokens, "chat": True}
        r = await client.post(url, json={"inputs": [tensor], "parameters": params})
        r.raise_for_status()

    started = time.perf_counter()
    await infer(PROMPTS[1])
    one = time.perf_counter() - started
    started = time.perf_counter()
    # the same prompt 16 times: greedy, so every request does the same work as the single one
    await asyncio.gather(*(infer(PROMPTS[1]) for _ in range(16)))
    sixteen = time.perf_counter() - started
    print(f"\nV2 infer: one request {one:.2f} s; 16 concurrent {sixteen:.2f} s "
          f"= {sixteen / one:.1f}x the time of one (16x would be no batching)")  # fmt: skip


COUNTERS = (
    ("predictor_prefix_cache_queries_total", "predictor_prefix_cache_hits_total"),
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
)


async def prefix_counters(client: httpx.AsyncClient, base: str) -> tuple[float, float] | None:
    """(queries, hits) token counters from the server's /metrics (ours or vLLM's), if any."""
    try:
        response = await client.get(f"{base}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    for queries, hits in COUNTERS:
        if queries in values:
            return values[queries], values.get(hits, 0.0)
    return None


async def shared_prefix(
    client: httpx.AsyncClient,
    api: Api,
    base: str,
    concurrency: list[int],
    requests: int,
    max_tokens: int,
    document: str = DOCUMENT,
) -> list[dict]:
    """The shared-prefix workload: per C, at least `requests` requests (C at a time), each the
    document and a new question; the hit rate of each level beside its latencies."""
    url = api.url(base)
    await one_stream(client, api, url, shared_prefix_prompts(1, 1000, document)[0], 4)  # warm
    rows, offset = [], 0
    for c in concurrency:
        rounds = max(1, -(-requests // c))
        prompts = shared_prefix_prompts(rounds * c, offset, document)
        offset += rounds * c
        before = await prefix_counters(client, base)
        row = await level(client, api, url, c, rounds, max_tokens, prompts)
        after = await prefix_counters(client, base)
        if row["hit_rate"] is None and before and after and after[0] > before[0]:
            row["hit_rate"] = (after[1] - before[1]) / (after[0] - before[0])
        rows.append(row)
    return rows


def hit_rate(row: dict) -> str:
    return "-" if row.get("hit_rate") is None else f"{row['hit_rate'] * 100:.0f}%"


def print_shared(rows: list[dict]) -> None:
    print(f"{'C':>3} {'requests':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'tokens/s':>9} "
          f"{'hit rate':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['c']:>3} {r['requests']:>8} {r['ttft_p50'] * 1000:>7.0f}ms "
              f"{r['ttft_p95'] * 1000:>7.0f}ms {r['tok_s']:>9.1f} {hit_rate(r):>8}")  # fmt: skip


async def run(args: argparse.Namespace, base: str) -> None:
    api = Api(args.api, args.model, args.openai_prefix, args.ignore_eos, args.unique)
    url = api.url(base)
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=64)) as client:
        if args.workload == "shared-prefix":
            document = DOCUMENT[: args.document_chars or None]
            rows = await shared_prefix(
                client, api, base, args.concurrency, args.requests, args.max_tokens, document
            )
            print(f"\n{url}: shared prefix ({len(document)} characters) + a new question, "
                  f"{args.max_tokens} new tokens per request")  # fmt: skip
            print_shared(rows)
            return
        await one_stream(client, api, url, "warm up", 4)
        rows = [
            await level(client, api, url, c, args.rounds, args.max_tokens) for c in args.concurrency
        ]
        print(f"\n{url}: {args.max_tokens} new tokens per request, {args.rounds} rounds per level")
        print(f"{'C':>3} {'requests':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} "
              f"{'ITL p95':>8} {'tokens/s':>9}")  # fmt: skip
        for r in rows:
            print(f"{r['c']:>3} {r['requests']:>8} {r['ttft_p50'] * 1000:>7.0f}ms "
                  f"{r['ttft_p95'] * 1000:>7.0f}ms {r['itl_p50'] * 1000:>6.0f}ms "
                  f"{r['itl_p95'] * 1000:>6.0f}ms {r['tok_s']:>9.1f}")  # fmt: skip
        by_c = {r["c"]: r for r in rows}
        if 1 in by_c and 16 in by_c:
            print(f"\ntokens/s at C=16 / C=1: {by_c[16]['tok_s'] / by_c[1]['tok_s']:.2f}x")
        if args.infer_check:
            await infer_check(client, base, args.model, args.max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="base URL of a running server (default: start one)")
    parser.add_argument("--model", default="smollm2-135m-instruct-gptq")
    parser.add_argument("--model-dir", default="models/smollm2-135m-instruct-gptq")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--infer-check", action="store_true")
    parser.add_argument("--ignore-eos", action="store_true", help="always --max-tokens tokens")
    parser.add_argument("--api", choices=["oip", "openai"], default="oip")
    parser.add_argument("--workload", choices=["standard", "shared-prefix"], default="standard")
    parser.add_argument("--unique", action="store_true", help="no two prompts share a KV block")
    parser.add_argument("--requests", type=int, default=8, help="shared-prefix: per level")
    parser.add_argument(
        "--document-chars", type=int, default=0, help="shared-prefix: cut the document (0: all)"
    )
    parser.add_argument(
        "--server-args", default="", help="extra flags for the server this starts (no --url)"
    )
    parser.add_argument("--openai-prefix", default="/v1", help="/v1 (vLLM) or /openai/v1 (KServe)")
    parser.add_argument(
        "--null",
        action="store_true",
        help="start the server with --runner null (no model: the serving stack's own cost) and "
        "room for 256 streams",
    )
    args = parser.parse_args()
    log_file = Path("/tmp/bench-serving-server.log")
    if args.url:
        context = nullcontext(args.url)
    else:
        extra = (*(NULL_SERVER_ARGS if args.null else ()), *args.server_args.split())
        context = local_server(args.model_dir, args.model, log_file, extra=extra)
    with context as server:
        base = server if isinstance(server, str) else server.base_url
        asyncio.run(run(args, base))


if __name__ == "__main__":
    main()
