"""First token of a long shared prompt after a restart, with the disk prefix cache against cold
(a script, not a test): issue 66's goal, >= 10x sooner.

Each round: a server with --kv-offload-dir over an empty folder answers the prompt cold (every
token prefilled), then stops (SIGTERM: its cached blocks are saved); a second server over the
same folder (the restart) answers it again, its blocks read from disk. Both first-token times
are measured by the client (a stream's first chunk), and the two answers' greedy text must
match. The median of the rounds' ratios is the figure; the save at shutdown and the folder's
size are reported too.

    .venv/bin/python -m load.bench_kv_offload [--model-dir models/smollm2-135m-instruct-gptq]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from load.local_server import LocalServer, local_server
from predictor.toolchain import cpu_model

DOCUMENT = Path(__file__).with_name("document.txt")


def long_prompt(words: int) -> str:
    """About `words` * 2.7 tokens (SmolLM2's tokenizer): the document, repeated, each copy
    numbered (so no two copies' blocks are alike)."""
    text = DOCUMENT.read_text().split()
    out: list[str] = []
    copy = 0
    while len(out) < words:
        copy += 1
        out += [f"[part {copy}]", *text]
    return " ".join(out[:words])


def first_token(server: LocalServer, prompt: str) -> tuple[float, str, dict[str, Any]]:
    """Seconds to the stream's first token, the greedy text, the usage."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    text, usage, first = "", {}, None
    started = time.perf_counter()
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if first is None:
                    first = time.perf_counter() - started
                text += chunk["choices"][0].get("text", "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert first is not None, "no token came"
    return first, text, usage


def round_trip(model_dir: str, prompt: str, extra: list[str], logs: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="kv-offload-") as folder:
        flags = ["--kv-offload-dir", folder, "--kv-offload-size", "4", *extra]
        with local_server(model_dir, "m", logs / "cold.log", flags) as server:
            cold, cold_text, usage = first_token(server, prompt)
            stopping = time.perf_counter()
        saved = time.perf_counter() - stopping  # SIGTERM to exit: drain and the save
        files = list(Path(folder).glob("*/*.kv"))
        size = sum(p.stat().st_size for p in files)
        with local_server(model_dir, "m", logs / "warm.log", flags) as server:
            warm, warm_text, warm_usage = first_token(server, prompt)
    assert warm_text == cold_text, (cold_text, warm_text)
    cached = warm_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"prompt": usage["prompt_tokens"], "cold": cold, "warm": warm, "cached": cached,
            "files": len(files), "mib": size / 2**20, "stop": saved}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="models/smollm2-135m-instruct-gptq")
    parser.add_argument("--words", type=int, default=1500, help="prompt words (~2.7 tokens each)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    extra = ["--threads", str(args.threads)] if args.threads else []
    prompt = long_prompt(args.words)
    print(f"CPU: {cpu_model()}")
    ratios = []
    with tempfile.TemporaryDirectory(prefix="kv-offload-logs-") as logs:
        for i in range(args.rounds):
            r = round_trip(args.model_dir, prompt, extra, Path(logs))
            ratios.append(r["cold"] / r["warm"])
            print(f"round {i + 1}: {r['prompt']} prompt tokens, first token cold {r['cold']:.3f} "
                  f"s, after a restart from disk {r['warm']:.3f} s ({ratios[-1]:.1f}x), "
                  f"{r['cached']} cached; {r['files']} block files, {r['mib']:.0f} MiB; SIGTERM "
                  f"to exit with the save {r['stop']:.1f} s")  # fmt: skip
    print(f"median: first token {statistics.median(ratios):.1f}x sooner with the disk cache")


if __name__ == "__main__":
    main()
