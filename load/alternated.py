"""Servers measured in turns, for a ratio on a shared, noisy machine (load/bench_peers.py's
`--workload threads` and `--workload ttft`).

Every server is up at once and idle while another is measured; each round measures one level
(C requests at once, `requests` in all) of every server, in an order that reverses each round,
so drift over minutes falls on both sides of a pair. A ratio is taken within each round and its
median reported: the project's rule for comparing on these machines (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from load.bench_serving import PROMPTS, Api, level, one_stream, percentile


@dataclass
class Turns:
    """Each server's rows, one bench_serving.level() row per round."""

    c: int
    rows: dict[str, list[dict]] = field(default_factory=dict)

    def median(self, name: str, key: str) -> float:
        return statistics.median(row[key] for row in self.rows[name])

    def ratios(self, top: str, bottom: str, key: str) -> list[float]:
        """top / bottom of `key`, round by round."""
        pairs = zip(self.rows[top], self.rows[bottom], strict=True)
        return [a[key] / b[key] for a, b in pairs if b[key]]


def fresh_connections(most: int) -> httpx.Limits:
    """No connection kept alive between requests: llama-server closes an idle one, and a
    request sent on it as it closes fails with RemoteProtocolError (seen here)."""
    return httpx.Limits(max_connections=max(64, most), max_keepalive_connections=0)


def order(names: Sequence[str], round_: int) -> list[str]:
    """The servers' turns in a round: as given, then reversed, and so on."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


async def take_turns(
    urls: Mapping[str, str],
    model: str,
    c: int,
    rounds: int,
    requests: int,
    max_tokens: int,
    timeout: float = 600.0,
    unique: bool = False,
) -> Turns:
    """`rounds` rounds of one level of every server (`urls`: name -> base URL). `unique`: a
    system message no other request has, so no prompt is served from a prefix cache (the same
    prompts come back every round)."""
    api = Api("openai", model, "/v1", ignore_eos=True, unique=unique)
    turns = Turns(c, {name: [] for name in urls})
    limits = fresh_connections(2 * c)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for url in urls.values():  # warm up: first-request compilation and allocation
            await one_stream(client, api, api.url(url), "warm up", 8)
        for round_ in range(rounds):
            for name in order(list(urls), round_):
                row = await level(
                    client, api, api.url(urls[name]), c, max(1, requests // c), max_tokens
                )
                turns.rows[name].append(row)
                print(f"[alternated] round {round_ + 1} {name} C={c}: {row['tok_s']:.2f} tok/s, "
                      f"TTFT p50 {row['ttft_p50'] * 1000:.0f} ms", flush=True)  # fmt: skip
    return turns


async def timed_stream(
    client: httpx.AsyncClient, api: Api, url: str, prompt: str, max_tokens: int
) -> tuple[float, list[float]]:
    """When the request was sent, and when each piece of text came."""
    sent, times = time.perf_counter(), []
    async with client.stream("POST", url, json=api.body(prompt, max_tokens)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text, _ = api.read(json.loads(line[6:]))
                if text:
                    times.append(time.perf_counter())
    return sent, times


def split_gaps(
    streams: Sequence[tuple[float, list[float]]], windows: Sequence[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """The gaps between two tokens of `streams`, as (during a window, outside every window):
    a window is a request's wait for its first token (its prompt being prefilled)."""
    during, quiet = [], []
    for _, times in streams:
        for a, b in zip(times, times[1:], strict=False):
            overlaps = any(a < end and start < b for start, end in windows)
            (during if overlaps else quiet).append(b - a)
    return during, quiet


async def under_arrivals(
    client: httpx.AsyncClient, api: Api, url: str, running: int, arrivals: int,
    spacing: float, max_tokens: int, arrival_tokens: int = 4,
) -> dict:  # fmt: skip
    """`running` streams of `max_tokens`; once they decode, `arrivals` new requests of
    `arrival_tokens`, one every `spacing` s. ITL of the running streams while a prompt is being
    prefilled (from a request's send to its first token) and while none is."""
    streams = [asyncio.create_task(timed_stream(client, api, url, PROMPTS[i % len(PROMPTS)],
                                                max_tokens)) for i in range(running)]  # fmt: skip
    await asyncio.sleep(spacing)
    news = []
    for i in range(arrivals):
        prompt = PROMPTS[(running + i) % len(PROMPTS)]
        news.append(asyncio.create_task(timed_stream(client, api, url, prompt, arrival_tokens)))
        await asyncio.sleep(spacing)
    done = await asyncio.gather(*streams)
    new = await asyncio.gather(*news)
    windows = [(sent, times[0]) for sent, times in (*done, *new) if times]
    during, quiet = split_gaps(done, windows)
    return {
        "itl_p95_arrivals": percentile(during, 0.95) if during else 0.0,
        "itl_p95_quiet": percentile(quiet, 0.95) if quiet else 0.0,
        "itl_p50_arrivals": statistics.median(during) if during else 0.0,
        "itl_p50_quiet": statistics.median(quiet) if quiet else 0.0,
        "gaps": (len(during), len(quiet)),
        "ttft_p50_arrivals": statistics.median(t[0] - s for s, t in new if t) if new else 0.0,
    }


async def arrivals_turns(
    urls: Mapping[str, str], model: str, rounds: int, running: int, arrivals: int,
    spacing: float, max_tokens: int, timeout: float = 600.0,
) -> dict[str, list[dict]]:  # fmt: skip
    """`under_arrivals` of every server in turns (prompts unique: no prefix-cache hit)."""
    api = Api("openai", model, "/v1", ignore_eos=True, unique=True)
    rows: dict[str, list[dict]] = {name: [] for name in urls}
    limits = fresh_connections(2 * (running + arrivals))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for round_ in range(rounds):
            for name in order(list(urls), round_):
                row = await under_arrivals(client, api, api.url(urls[name]), running, arrivals,
                                           spacing, max_tokens)  # fmt: skip
                rows[name].append(row)
                print(f"[alternated] round {round_ + 1} {name} arrivals: ITL p95 "
                      f"{row['itl_p95_arrivals'] * 1000:.0f} ms while prefilling, "
                      f"{row['itl_p95_quiet'] * 1000:.0f} ms quiet", flush=True)  # fmt: skip
    return rows


def arrivals_table(rows: Mapping[str, list[dict]]) -> list[str]:
    """Per server, medians over rounds: ITL p50 / p95 of running streams while a prompt is
    prefilled and while none is, and the arrivals' TTFT p50."""
    head = ["server", "ITL p50 ms quiet / prefilling", "ITL p95 ms quiet / prefilling",
            "gaps quiet / prefilling", "arrivals' TTFT p50 ms"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, each in rows.items():

        def ms(key: str, each: list[dict] = each) -> str:
            return f"{statistics.median(r[key] for r in each) * 1000:.0f}"

        gaps = f"{sum(r['gaps'][1] for r in each)} / {sum(r['gaps'][0] for r in each)}"
        lines.append(f"| {name} | {ms('itl_p50_quiet')} / {ms('itl_p50_arrivals')} | "
                     f"{ms('itl_p95_quiet')} / {ms('itl_p95_arrivals')} | {gaps} | "
                     f"{ms('ttft_p50_arrivals')} |")  # fmt: skip
    return lines


def ratio_cell(ratios: Sequence[float]) -> str:
    """'1.23x (1.10, 1.23, 1.31)': the median, then each round's."""
    if not ratios:
        return "-"
    each = ", ".join(f"{r:.2f}" for r in ratios)
    return f"{statistics.median(ratios):.2f}x ({each})"


def threads_table(turns: Turns, sides: Sequence[str], threads: Sequence[int]) -> list[str]:
    """Per side: median tok/s and ITL p50 at each thread count, and the paired ratio of the
    last thread count over the first (names in `turns`: f"{side} T={t}")."""
    low, high = threads[0], threads[-1]
    head = ["side", *(f"T={t} tok/s" for t in threads), *(f"T={t} ITL p50 ms" for t in threads)]
    head.append(f"T{high}/T{low} tok/s, median of paired rounds (each round)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for side in sides:
        names = [f"{side} T={t}" for t in threads]
        cells = [side, *(f"{turns.median(n, 'tok_s'):.2f}" for n in names)]
        cells += [f"{turns.median(n, 'itl_p50') * 1000:.0f}" for n in names]
        cells.append(ratio_cell(turns.ratios(names[-1], names[0], "tok_s")))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def ttft_table(levels: Sequence[Turns], names: Sequence[str], peer: str) -> list[str]:
    """Per C and server: median TTFT p50, ITL p50 and p95, tok/s, and each server's TTFT p50 over
    `peer`'s, paired by round."""
    head = ["C", "server", "TTFT p50 ms", "ITL p50 ms", "ITL p95 ms", "tok/s",
            f"TTFT p50 / {peer}'s, median of paired rounds (each round)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for turns in levels:
        for name in names:
            cells = [
                str(turns.c), name,
                f"{turns.median(name, 'ttft_p50') * 1000:.0f}",
                f"{turns.median(name, 'itl_p50') * 1000:.0f}",
                f"{turns.median(name, 'itl_p95') * 1000:.0f}",
                f"{turns.median(name, 'tok_s'):.1f}",
                "-" if name == peer else ratio_cell(turns.ratios(name, peer, "ttft_p50")),
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def wrap(text: str) -> list[str]:
    return textwrap.wrap(text, 100, break_long_words=False, break_on_hyphens=False)
