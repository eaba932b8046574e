"""How long a server takes to be ready at a shape: a first start (empty `--autotune-cache`: the
kernels compiled, measured and their layouts built) and restarts (the cache read back, the
layouts mapped), each phase as the server's own log gives it (`ready after ...`).

    python -m load.bench_startup --shape smollm2-1.7b [--restarts 3] [--threads 1]

The checkpoint is models/shapes/SHAPE/gptq (load/random_gptq.py's random weights, built here if
missing). Ready is the first 200 from /v2/health/ready, polled every 0.1 s from the spawn; the
RSS of the server is read after its first request; every start must give the same greedy text.
Issue 66's goals at the 1.7B shape: a first start <= 15 s, a restart <= 5 s.
"""

from __future__ import annotations

import argparse
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from load.random_gptq import SHAPES, Layout, write_checkpoint
from predictor.model.env import cpu_name

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "models" / "smollm2-135m-instruct-fp"
READY = re.compile(r"ready after ([\d.]+) s: (.+)")


@dataclass
class Start:
    kind: str
    seconds: float  # spawn to the first 200 from /v2/health/ready
    phases: str  # the server's own account
    rss_gb: float
    text: str


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_once(model: Path, cache: Path, threads: int, kind: str, log: Path) -> Start:
    http, grpc = free_port(), free_port()
    command = [sys.executable, "-m", "predictor", "--model-dir", str(model), "--threads",
               str(threads), "--autotune-cache", str(cache), "--http-port", str(http),
               "--grpc-port", str(grpc)]  # fmt: skip
    started = time.perf_counter()
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http}"
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited ({server.returncode}): see {log}")
            try:
                if httpx.get(f"{base}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        seconds = time.perf_counter() - started
        name = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        text = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
        # after a request: a mapped layout's pages count once a step has read them
        rss = psutil.Process(server.pid).memory_info().rss / 2**30
    finally:
        server.terminate()
        server.wait(60)
    found = READY.search(log.read_text(errors="replace"))
    return Start(kind, seconds, found[0] if found else "?", rss, text["choices"][0]["text"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(set(SHAPES) - {"tiny"}), default="smollm2-1.7b")
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    model = REPO / "models" / "shapes" / args.shape / "gptq"
    if not (model / "config.json").is_file():
        print(f"writing {model} (random weights)", flush=True)
        write_checkpoint(model, SHAPES[args.shape], Layout(4, 32, sym=False), TOKENIZER)
    print(f"{cpu_name()}, load average {psutil.getloadavg()[0]:.1f}, {args.shape}, "
          f"{args.threads} threads", flush=True)  # fmt: skip
    starts: list[Start] = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as folder:
        cache = Path(folder) / "cache"
        for i in range(1 + args.restarts):
            kind = "first start" if i == 0 else "restart"
            start = start_once(model, cache, args.threads, kind, Path(folder) / f"{i}.log")
            starts.append(start)
            print(f"{kind}: ready in {start.seconds:.1f} s, RSS {start.rss_gb:.2f} GiB; "
                  f"{start.phases}", flush=True)  # fmt: skip
    if len({s.text for s in starts}) != 1:
        raise SystemExit(f"the starts gave different greedy texts: {[s.text for s in starts]}")
    restarts = [s.seconds for s in starts[1:]]
    if restarts:
        print(f"first start {starts[0].seconds:.1f} s; restart median "
              f"{statistics.median(restarts):.1f} s (goals: 15 s, 5 s)")  # fmt: skip
    print(f"load average at the end {psutil.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
