"""Measure the server's resident memory: idle once ready, and peak under a short load.

Starts `python -m predictor --model-dir MODEL` (default flags, plus --threads and free loopback
ports) with HOME set to an empty folder, as a pod starts with empty caches (an emptyDir at
/home/app/.cache: kernels are compiled and autotuned again at every start). Waits for
/v2/health/ready, lets it settle, reads VmRSS, then sends ROUNDS rounds of CONCURRENCY
concurrent V2 /generate requests of exactly TOKENS tokens each (ignore_eos) while sampling VmRSS
every 20 ms. Reported: idle RSS, the sampled peak under load, and the kernel's high-water mark
(VmHWM) at ready and at the end: the process's peak over its whole life, the model load
included, which is what a memory limit must hold. The figures set the memory requests and
limits in manifests/ (manifests/README.md, "Memory").

    .venv/bin/python tools/measure_rss.py --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(field)


def tree_rss_kib(root: int) -> int:
    """VmRSS of `root` and its descendants (the compiler runs at start, in the pod's cgroup)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, total = {root}, 0
    grown = True  # a child's pid may be lower than its parent's: walk until nothing joins
    while grown:
        grown = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grown = True
    for pid in tree:
        with contextlib.suppress(OSError, LookupError):
            total += status_kib(pid, "VmRSS")
    return total


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server not ready after {timeout} s")


async def one_round(url: str, model: str, concurrency: int, tokens: int) -> list[int]:
    body = {"text_input": PROMPT, "parameters": {"max_tokens": tokens, "ignore_eos": True}}
    async with httpx.AsyncClient(timeout=600) as client:

        async def call() -> int:
            response = await client.post(f"{url}/v2/models/{model}/generate", json=body)
            response.raise_for_status()
            return int(response.json().get("usage", {}).get("completion_tokens", tokens))

        return list(await asyncio.gather(*(call() for _ in range(concurrency))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/smollm2-135m-instruct-gptq"))
    parser.add_argument("--threads", type=int, default=0, help="server --threads (0: default)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds idle before reading")
    args = parser.parse_args(argv)

    model = args.model_dir.name
    http_port = free_port()
    command = [sys.executable, "-m", "predictor", "--model-dir", str(args.model_dir),
               "--http-port", str(http_port), "--grpc-port", str(free_port())]  # fmt: skip
    if args.threads:
        command += ["--threads", str(args.threads)]
    url = f"http://127.0.0.1:{http_port}"
    with tempfile.TemporaryFile() as log, tempfile.TemporaryDirectory() as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")} | {"HOME": home}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        tree: list[int] = []  # the process tree's RSS from the start, every 50 ms
        stopped = threading.Event()

        def sample_tree() -> None:
            while not stopped.is_set():
                tree.append(tree_rss_kib(process.pid))
                time.sleep(0.05)

        threading.Thread(target=sample_tree, daemon=True).start()
        try:
            ready_s = wait_ready(url, process, timeout=600)
            tree_at_ready = len(tree)
            hwm_ready = status_kib(process.pid, "VmHWM")
            time.sleep(args.settle)
            idle = status_kib(process.pid, "VmRSS")
            samples: list[int] = []
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    samples.append(status_kib(process.pid, "VmRSS"))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.monotonic()
            generated = [asyncio.run(one_round(url, model, args.concurrency, args.tokens))
                         for _ in range(args.rounds)]  # fmt: skip
            elapsed = time.monotonic() - started
            done.set()
            sampler.join()
            hwm = status_kib(process.pid, "VmHWM")
            after = status_kib(process.pid, "VmRSS")
            stopped.set()
        finally:
            process.terminate()
            process.wait(timeout=120)
    report = {
        "command": " ".join(command),
        "cpu": cpu_model(),
        "ready_s": round(ready_s, 1),
        "idle_rss_mib": idle >> 10,
        "load_peak_rss_mib": max(samples) >> 10,
        "hwm_at_ready_mib": hwm_ready >> 10,
        "hwm_at_end_mib": hwm >> 10,
        "tree_peak_start_mib": max(tree[:tree_at_ready]) >> 10,
        "tree_peak_all_mib": max(tree) >> 10,
        "after_load_rss_mib": after >> 10,
        "load": f"{args.rounds} rounds x {args.concurrency} concurrent x {args.tokens} tokens",
        "tokens_generated": sum(map(sum, generated)),
        "load_s": round(elapsed, 1),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
