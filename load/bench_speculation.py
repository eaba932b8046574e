"""Speculative decoding on four request kinds: ours with and without, llama.cpp's server with and
without its n-gram speculation, same model weights, threads, client and prompts.

    python -m load.bench_speculation [--llama-server PATH] [--concurrency 1 16]

The kinds (prompts in load/speculation/, written for this project): questions answered by quoting
a long document (`doc_qa`), a code edit returning the whole file (`code_edit`), JSON extracted
from a text (`json_extract`) and free chat (`chat`, nothing to copy). Each level sends C greedy
OpenAI chat completions at once (C=1: the kind's prompts one after another), `max_tokens` each,
and counts the completion tokens the servers report over the level's wall time. Every server is
restarted for each level (nothing learned from one level helps the next). Ours also reports its
drafts' acceptance (from /metrics) and whether its texts equal those without speculation.

Two of our servers measured a minute apart differ by ~5-10% on a shared machine (a plain
decode step reads memory, a drafted one computes: a neighbour's memory traffic slows the
first more). `--rounds N` measures ours off and on N times, in alternating order, each time
on fresh servers, and reports the median of each round's ratio with its range; llama.cpp's
servers are measured once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from load.bench_peers import gguf_file, llama_server
from load.local_server import local_server
from predictor.engine.runners.native.bindings import cpu_model

PROMPTS = Path(__file__).resolve().parent / "speculation"
KINDS = ("doc_qa", "code_edit", "json_extract", "chat")
MODEL = "gptq"
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models/smollm2-135m-instruct-gptq"


def conversations(kind: str) -> list[list[dict[str, str]]]:
    """The kind's requests, as chat messages."""
    data = json.loads((PROMPTS / f"{kind}.json").read_text())
    if kind == "doc_qa":
        texts = [f"Document:\n{data['document']}\n\nQuestion: {q}" for q in data["questions"]]
    elif kind == "code_edit":
        texts = [f"{data['instruction']}\n\n```python\n{f}```" for f in data["files"]]
    elif kind == "json_extract":
        texts = [f"{data['instruction']}\n\nText: {t}" for t in data["texts"]]
    else:
        texts = list(data["prompts"])
    return [[{"role": "user", "content": text}] for text in texts]


@dataclass
class Level:
    tokens_per_second: float
    texts: list[str]
    drafts: float = 0.0  # draft tokens verified (ours)
    accepted: float = 0.0


@dataclass
class Server:
    name: str
    start: Any  # (concurrency) -> context manager yielding a base URL
    results: dict[tuple[str, int], Level] = field(default_factory=dict)  # the first round's
    rounds: dict[tuple[str, int], list[Level]] = field(default_factory=dict)  # every round's


async def complete(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[str, int]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = await client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    data = response.json()
    return data["choices"][0]["message"]["content"], int(data["usage"]["completion_tokens"])


async def counters(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """Our draft tokens and accepted tokens so far (0, 0 on a server without them)."""
    try:
        text = (await client.get(f"{url}/metrics", timeout=30)).text
    except httpx.HTTPError:
        return 0.0, 0.0
    found = {"draft": 0.0, "accepted": 0.0}
    for line in text.splitlines():
        if line.startswith("predictor_spec_decode_num_draft_tokens_total"):
            found["draft"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("predictor_spec_decode_num_accepted_tokens_total"):
            found["accepted"] = float(line.rsplit(" ", 1)[1])
    return found["draft"], found["accepted"]


async def level(url: str, kind: str, c: int, max_tokens: int) -> Level:
    convs = conversations(kind)
    async with httpx.AsyncClient() as client:
        await complete(client, url, [{"role": "user", "content": "Hello"}], 8)  # warm
        before = await counters(client, url)
        started = time.perf_counter()
        if c == 1:
            done = [await complete(client, url, m, max_tokens) for m in convs]
        else:
            batch = [convs[i % len(convs)] for i in range(c)]
            done = await asyncio.gather(*(complete(client, url, m, max_tokens) for m in batch))
        seconds = time.perf_counter() - started
        after = await counters(client, url)
    tokens = sum(n for _, n in done)
    return Level(tokens / seconds, [t for t, _ in done], after[0] - before[0],
                 after[1] - before[1])  # fmt: skip


def ours(args: argparse.Namespace, speculative: str) -> Server:
    @contextmanager
    def start(c: int) -> Iterator[str]:
        log = args.log_dir / f"bench-speculation-ours-{speculative}.log"
        extra = ["--threads", str(args.threads), "--speculative", speculative,
                 "--max-batch-size", str(max(c, 16))]  # fmt: skip
        if speculative != "off" and args.num_speculative_tokens:
            extra += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
        with local_server(str(args.model_dir), MODEL, log, extra=extra) as server:
            wait_complete(log)
            yield server.base_url

    return Server(f"ours, speculative {speculative}", start)


def wait_complete(log: Path, timeout: float = 300.0) -> None:
    """Until the server's kernels are all built (the bf16 copies come after ready): measured
    before, a long prompt would prefill on another kernel, and the texts of two servers
    differ where a near-tie falls the other way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "every plan complete" in text or ("kernels:" in text and "after ready" not in text):
            return
        time.sleep(0.5)
    raise TimeoutError(f"the server's kernels were not complete after {timeout} s ({log})")


def llama(args: argparse.Namespace, spec_type: str) -> Server:
    @contextmanager
    def start(c: int) -> Iterator[str]:
        log = args.log_dir / f"bench-speculation-llama-{spec_type}.log"
        extra = ["--spec-type", spec_type] if spec_type != "none" else []
        with llama_server(args.llama_server, gguf_file(), MODEL, args.threads, c, log,
                          args.llama_ctx, 600, extra) as server:  # fmt: skip
            yield server.base_url

    return Server(f"llama.cpp, --spec-type {spec_type}", start)


def measure(server: Server, args: argparse.Namespace) -> None:
    for c in args.concurrency:
        context: AbstractContextManager[str] = server.start(c)
        with context as url:
            for kind in args.kinds:
                result = asyncio.run(level(url, kind, c, args.max_tokens))
                server.results.setdefault((kind, c), result)
                server.rounds.setdefault((kind, c), []).append(result)
                extra = ""
                if result.drafts:
                    extra = f", acceptance {result.accepted / result.drafts:.2f}"
                print(f"[bench-speculation] {server.name} {kind} C={c}: "
                      f"{result.tokens_per_second:.1f} tok/s{extra}", flush=True)  # fmt: skip


def report(servers: list[Server], args: argparse.Namespace) -> list[str]:
    off, on, *peers = servers
    peer_heads = "".join(f" {p.name} tok/s |" for p in peers)
    rounds = max((len(levels) for levels in on.rounds.values()), default=1)
    median = f"; ours: median of {rounds} rounds (range), acceptance and texts of the first"
    lines = [
        f"CPU: {cpu_model()}; {args.threads} thread(s) each; max_tokens {args.max_tokens}, greedy"
        + (median if rounds > 1 else ""),
        "",
        "| kind | C | ours off tok/s | ours on tok/s | on / off | acceptance | same text |"
        + peer_heads
        + (" ours on / best llama.cpp |" if peers else ""),
        "|---|---|---|---|---|---|---|" + "---|" * (len(peers) + bool(peers)),
    ]
    for kind in args.kinds:
        for c in args.concurrency:
            a, b = off.results[(kind, c)], on.results[(kind, c)]
            same = sum(x == y for x, y in zip(a.texts, b.texts, strict=True))
            acceptance = f"{b.accepted / b.drafts:.2f}" if b.drafts else "no drafts"
            offs, ons = off.rounds.get((kind, c), [a]), on.rounds.get((kind, c), [b])
            pairs = list(zip(offs, ons, strict=True))
            ratios = sorted(y.tokens_per_second / x.tokens_per_second for x, y in pairs)
            ratio = f"{statistics.median(ratios):.2f}x"
            if len(ratios) > 1:
                ratio += f" ({ratios[0]:.2f}-{ratios[-1]:.2f})"
            speeds = [statistics.median(level.tokens_per_second for level in levels)
                      for levels in (offs, ons)]  # fmt: skip
            cells = "".join(f" {p.results[(kind, c)].tokens_per_second:.1f} |" for p in peers)
            if peers:
                best = max(p.results[(kind, c)].tokens_per_second for p in peers)
                cells += f" {speeds[1] / best:.2f}x |"
            lines.append(
                f"| {kind} | {c} | {speeds[0]:.1f} | {speeds[1]:.1f} | {ratio} | {acceptance} | "
                f"{same}/{len(a.texts)} |{cells}"
            )
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--llama-server", default="", help="llama-server binary ('': none)")
    parser.add_argument("--llama-spec-types", nargs="+", default=["none", "ngram-mod",
                        "ngram-simple"])  # fmt: skip
    parser.add_argument("--llama-ctx", type=int, default=32768)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--speculative", default="suffix", choices=("ngram", "suffix"))
    parser.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="ours on: draft tokens at most (0: its default)")  # fmt: skip
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--rounds", type=int, default=1,
                        help="ours off and on, this many times in alternating order")  # fmt: skip
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    servers = [ours(args, "off"), ours(args, args.speculative)]
    for n in range(args.rounds):  # off, on; on, off; ...: a drift weighs on both alike
        for server in servers if n % 2 == 0 else servers[::-1]:
            measure(server, args)
    if args.llama_server:
        servers += [llama(args, spec) for spec in args.llama_spec_types]
        for server in servers[2:]:
            measure(server, args)
    print("\n".join(report(servers, args)))


if __name__ == "__main__":
    main()
