"""The GPU path's device script: its tests and benchmarks in one run on a CUDA machine.

On the development machine, once (downloads the wheels the GPU machine lacks, for its Python,
and stages the default tokenizer; `.gpu/` is git-ignored):

    .venv/bin/python -m load.gpu_check --prepare

On the GPU machine (its own Python 3.12, torch, Triton and transformers; no package registry),
with `.gpu` carried:

    python3 load/gpu_check.py --out $OUT

It installs the carried wheels into a temporary folder, runs the tests marked `cuda`, then
benchmarks two random-weight GPTQ checkpoints built on the spot (the default model's shape,
SmolLM2-135M, group 32 asym as `make model` builds it; and SmolLM2-1.7B's shape, group 128 sym as
most Hub checkpoints are): our engine (the real wiring, `build_engine`, CUDA graphs on) at C=1,
16 and 64 against transformers' `generate` on the same checkpoint on the same GPU (its GPTQ
Linears dequantized to bf16 nn.Linear: gptqmodel, whose kernels are compiled at install, has no
wheel for that machine), batch 1 and batched; and the 1.7B decode step against the HBM roofline
(the bytes a step must read / 4.8 TB/s). It prints one table and writes it, with the logs, under
--out. Budget: well under 8 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STAGE = REPO / ".gpu"
WHEELS = STAGE / "wheels"
TOKENIZER = STAGE / "tokenizer"
SITE = Path("/tmp/gpu-check-site")
EXPORTED = REPO / "models" / "smollm2-135m-instruct-fp"  # where tests.support looks first
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# What the server and the tests import that the GPU machine's image lacks (its package list:
# the device tool's KINDS.md), at the versions of this project's own environment; grpcio and
# protobuf too, since the generated code requires the versions it was generated with. Not
# carried: what is imported only if present (kubernetes-validate: 22 MB; dill, brotli, chardet).
DEVICE_WHEELS = (
    "annotated-types", "apache-tvm-ffi", "blinker", "cloudevents", "deprecation", "durationpy",
    "fastapi", "grpc-interceptor", "grpcio", "grpcio-tools", "httpcore2", "httptools", "httpx2",
    "importlib-resources", "jsonschema", "jsonschema-specifications", "kserve", "kubernetes",
    "oauthlib",
    "openai", "opentelemetry-api", "orjson", "protobuf", "pydantic", "pydantic-core",
    "python-multipart", "pytz", "referencing", "requests-oauthlib", "rpds-py", "sniffio",
    "starlette", "timing-asgi", "truststore", "typing-inspection", "uvicorn", "watchfiles",
    "websocket-client", "websockets", "xgrammar",
)  # fmt: skip
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
             "any")  # fmt: skip
HBM_BYTES_PER_SECOND = 4.8e12  # the H200's datasheet figure
NEW_TOKENS = 128
PROMPT_TOKENS = 64


def prepare() -> None:
    """Here: the wheels for the device's Python 3.12, and the default tokenizer."""
    from importlib.metadata import version

    if WHEELS.exists():
        shutil.rmtree(WHEELS)
    WHEELS.mkdir(parents=True)
    pins = [f"{name}=={version(name)}" for name in DEVICE_WHEELS]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(WHEELS)]  # fmt: skip
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run([*command, *pins], check=True)
    TOKENIZER.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(EXPORTED / name, TOKENIZER / name)
    size = sum(f.stat().st_size for f in STAGE.rglob("*") if f.is_file())
    print(f"{STAGE}: {len(pins)} wheels and the tokenizer, {size / 2**20:.1f} MiB")


def install() -> dict[str, str]:
    """There: the carried wheels into a temporary folder; the environment that imports them."""
    if not SITE.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--target", str(SITE), *map(str, WHEELS.glob("*.whl"))],
                       check=True)  # fmt: skip
    EXPORTED.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER / name, EXPORTED / name)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(REPO), env.get("PYTHONPATH", "")])
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_tests(env: dict[str, str], out: Path, timeout: float) -> dict[str, Any]:
    """The tests marked `cuda`, in a process of their own; their summary line."""
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfEs", "-p",
               "no:cacheprovider", "tests/engine/runners/cuda",
               "tests/engine/runners/test_internals.py"]  # fmt: skip
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        text, code = f"{expired.stdout or ''}{expired.stderr or ''}\nTIMED OUT", -1
    (out / "tests.log").write_text(text)
    lines = [line for line in text.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " in " in line and "=" in line), "")
    print(text[-6000:])
    return {"exit": code, "summary": summary.strip("= "), "seconds": time.perf_counter() - started}


def gpu_facts() -> dict[str, Any]:
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    size = 1 << 30
    a = torch.empty(size, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    copy = 2 * size * 10 / (start.elapsed_time(end) / 1000)  # bytes read + written per second
    del a, b
    return {"gpu": props.name, "memory_gib": props.total_memory / 2**30, "torch": torch.__version__,
            "triton": triton.__version__, "copy_bytes_per_second": copy}  # fmt: skip


def build_models(work: Path) -> dict[str, Path]:
    from load.random_gptq import SHAPES, Layout, write_checkpoint

    models = {
        "default (SmolLM2-135M shape, g32 asym)": ("smollm2-135m", Layout(4, 32, sym=False)),
        "1.7B (SmolLM2-1.7B shape, g128 sym)": ("smollm2-1.7b", Layout(4, 128, sym=True)),
    }
    built = {}
    for label, (shape, layout) in models.items():
        started = time.perf_counter()
        built[label] = write_checkpoint(work / shape, SHAPES[shape], layout, TOKENIZER,
                                        device="cuda")  # fmt: skip
        print(f"built {label} in {time.perf_counter() - started:.1f} s")
    return built


def bench_ours(path: Path, concurrencies: list[int]) -> dict[str, Any]:
    """Our engine as the server wires it: tok/s at each concurrency, the decode step at C=1."""
    import torch
    from prometheus_client import CollectorRegistry

    from predictor.config import LimitsSettings, SchedulerSettings, Settings
    from predictor.engine_assembly import build_engine
    from predictor.model.loader import load_checkpoint
    from predictor.observability.metrics import Metrics
    from predictor.types import GenerateRequest, SamplingParams

    started = time.perf_counter()
    loaded = load_checkpoint(path, device="cuda")
    loaded_at = time.perf_counter()
    settings = Settings(
        scheduler=SchedulerSettings(max(concurrencies), max_waiting=1024, max_step_tokens=1024),
        limits=LimitsSettings(max_tokens_limit=1024),
    )
    metrics = Metrics(CollectorRegistry(), "bench")
    steps: list[float] = []
    observe = metrics.observe_batch

    def stamped(rows: int) -> None:
        steps.append(time.perf_counter())
        observe(rows)

    metrics.observe_batch = stamped  # type: ignore[method-assign]
    engine = build_engine(loaded, settings, metrics)
    runner = engine._loop.runner  # type: ignore[attr-defined]
    vocab = len(loaded.tokenizer)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(100, vocab, (PROMPT_TOKENS,), generator=generator).tolist()

    async def one(i: int) -> int:
        request = GenerateRequest(f"b{i}", "", params, prompt_ids=tuple(prompt()))
        count = 0
        async for event in engine.generate(request):
            count += len(event.token_ids)
        return count

    async def run(c: int) -> tuple[float, float]:
        steps.clear()
        begun = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(c)))
        seconds = time.perf_counter() - begun
        gaps = [b - a for a, b in zip(steps[2:], steps[3:], strict=False)]
        return sum(counts) / seconds, statistics.median(gaps) if gaps else float("nan")

    engine.start()
    try:
        while not engine._loop.prepared.is_set():  # type: ignore[attr-defined]
            time.sleep(0.05)
        ready = time.perf_counter()
        asyncio.run(run(2))  # warm: the first steps of each shape
        results = {c: asyncio.run(run(c)) for c in concurrencies}
    finally:
        engine.stop()
    graph_us = _graph_step_us(runner)
    return {
        "load_s": loaded_at - started,
        "ready_s": ready - loaded_at,
        "tok_s": {c: r[0] for c, r in results.items()},
        "step_ms": {c: r[1] * 1000 for c, r in results.items()},
        "graph_step_us": graph_us,
        "step_bytes": _step_bytes(runner, PROMPT_TOKENS + NEW_TOKENS // 2),
        "choices": runner.choices.plans if runner.choices else {},
        "attention": runner.attention,
    }


def _graph_step_us(runner: Any) -> float:
    """The GPU time of one decode step at one row: its graph replayed (context as left)."""
    import torch

    graph = runner._graphs.get(1)
    if graph is None:
        return float("nan")
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def _step_bytes(runner: Any, context: int) -> int:
    """What a one-row decode step must read: every projection's weights as its chosen
    kernel stores them, the head, and the row's keys and values."""
    total = 0
    for linear in runner._linears()[0]:
        n, k, group, bits = linear.shape
        kernel = next(name for rows, name in linear.plan if rows == 1)
        groups = k // group
        if kernel == "dense":
            total += n * k * 2
        elif kernel == "tinygemm":
            total += n * k // 2 + groups * n * 2 * 2
        else:
            total += n * k * bits // 8 + groups * n * (2 + 1)
    total += runner._head.numel() * runner._head.element_size()
    layers, kv = len(runner._layers), 2 * runner.kv_heads * runner.head_dim * 2
    return total + layers * kv * context


def bench_transformers(path: Path, batches: list[int]) -> dict[int, float]:
    """transformers' generate on the same checkpoint, its GPTQ Linears dequantized to bf16."""
    import torch

    from predictor.model.loader import load_checkpoint

    loaded = load_checkpoint(path, device="cuda", kernel="dequantized")
    vocab = len(loaded.tokenizer)
    generator = torch.Generator().manual_seed(1)
    rates = {}
    for batch in batches:
        ids = torch.randint(100, vocab, (batch, PROMPT_TOKENS), generator=generator).cuda()

        def generate(new: int, ids: torch.Tensor = ids, model: Any = loaded) -> None:
            with torch.inference_mode():
                model.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, pad_token_id=model.pad_token_id,
                )  # fmt: skip

        generate(4)
        torch.cuda.synchronize()
        begun = time.perf_counter()
        generate(NEW_TOKENS)
        torch.cuda.synchronize()
        rates[batch] = batch * NEW_TOKENS / (time.perf_counter() - begun)
    del loaded
    torch.cuda.empty_cache()
    return rates


def table(facts: dict[str, Any], tests: dict[str, Any], benches: dict[str, Any]) -> str:
    lines = [
        f"GPU: {facts.get('gpu')} ({facts.get('memory_gib', 0):.0f} GiB), torch "
        f"{facts.get('torch')}, Triton {facts.get('triton')}; device copy "
        f"{facts.get('copy_bytes_per_second', 0) / 1e12:.2f} TB/s (read + write)",
        f"tests -m cuda: {tests.get('summary')} (exit {tests.get('exit')}, "
        f"{tests.get('seconds', 0):.0f} s)",
        "",
        f"{'model':<40} {'C':>3} {'ours tok/s':>11} {'step ms':>8} {'HF tok/s':>9} "
        f"{'x HF same C':>11} {'x HF b1':>8}",
    ]
    for label, bench in benches.items():
        if "error" in bench:
            lines.append(f"{label:<40} failed: {bench['error']}")
        if "ours" not in bench:
            continue
        ours, hf = bench["ours"], bench.get("hf") or {1: float("nan")}
        for c, rate in ours["tok_s"].items():
            same = hf.get(c)
            lines.append(
                f"{label:<40} {c:>3} {rate:>11.0f} {ours['step_ms'][c]:>8.2f} "
                f"{same if same else float('nan'):>9.0f} "
                f"{rate / same if same else float('nan'):>11.2f} {rate / hf[1]:>8.2f}"
            )
        roofline_us = ours["step_bytes"] / HBM_BYTES_PER_SECOND * 1e6
        step_us = ours["step_ms"][1] * 1000
        lines.append(
            f"{'':<40} load {ours['load_s']:.1f} s, ready {ours['ready_s']:.1f} s; C=1 step "
            f"{step_us:.0f} us ({ours['graph_step_us']:.0f} us GPU, graph); roofline "
            f"{roofline_us:.0f} us ({ours['step_bytes'] / 1e6:.0f} MB / 4.8 TB/s): "
            f"{100 * roofline_us / step_us:.0f}% of it "
            f"({100 * roofline_us / ours['graph_step_us']:.0f}% of the GPU time); decode "
            f"attention {ours['attention']}"
        )
    return "\n".join(lines)


def check(out: Path, skip_tests: bool, test_timeout: float) -> None:
    env = install()
    if os.environ.get("GPU_CHECK_CHILD") != "1":  # again, importing the carried wheels
        env["GPU_CHECK_CHILD"] = "1"
        args = [sys.executable, __file__, "--out", str(out), "--test-timeout", str(test_timeout)]
        os.execve(sys.executable, args + (["--skip-tests"] if skip_tests else []), env)
    import logging

    handlers: list[logging.Handler] = [logging.FileHandler(out / "bench.log")]
    handlers.append(logging.StreamHandler())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=handlers)  # fmt: skip
    facts = gpu_facts()
    print(json.dumps(facts))
    tests = {"summary": "skipped"} if skip_tests else run_tests(env, out, test_timeout)
    benches: dict[str, Any] = {}
    for label, path in build_models(Path("/tmp/gpu-check-models")).items():
        benches[label] = {}
        for part, bench in (("hf", bench_transformers), ("ours", bench_ours)):
            try:
                benches[label][part] = bench(path, [1, 16, 64])
            except Exception as error:  # the table says which part failed; the log has the trace
                traceback.print_exc()
                benches[label]["error"] = f"{part}: {type(error).__name__}: {error}"
    text = table(facts, tests, benches)
    (out / "gpu_check.txt").write_text(text + "\n")
    (out / "gpu_check.json").write_text(json.dumps(
        {"facts": facts, "tests": tests, "benches": benches}, indent=1, default=str))  # fmt: skip
    print("\n" + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="here: stage wheels and tokenizer")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "load/out")))
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--test-timeout", type=float, default=240.0)
    args = parser.parse_args()
    if args.prepare:
        prepare()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    check(args.out, args.skip_tests, args.test_timeout)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
