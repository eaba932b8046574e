"""Exact counter values and histogram counts after a known mix of requests."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry

from predictor.engine.async_engine import AsyncEngine
from predictor.engine.client import complete
from predictor.errors import InvalidRequest
from predictor.observability.metrics import METRICS, Metrics
from predictor.observability.observer import Observer
from predictor.types import GenerateRequest, SamplingParams
from tests.engine.conftest import Tiny, new_loop


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, {"model": "tiny", **labels})
    return 0.0 if got is None else got


async def test_known_mix(tiny_dense: Tiny) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, "tiny")
    observer = Observer(metrics)
    loop = new_loop(tiny_dense.runner(), frozenset())
    engine = AsyncEngine(loop, tiny_dense.tokenizer, max_tokens_limit=64, max_prompt_tokens=100,
                         on_step=metrics.observe_step)  # fmt: skip
    metrics.track_engine(engine.running, engine.waiting)
    engine.start()
    try:
        prompts = {"a": "Hello", "b": "The sky", "c": "Count to ten", "d": "x"}
        lengths = {"a": 5, "b": 7, "c": 3}
        unary = [
            complete(
                observer.observe(
                    engine.generate(
                        GenerateRequest(k, prompts[k], SamplingParams(max_tokens=lengths[k]))
                    ),
                    "rest",
                )
            )
            for k in ("a", "b")
        ]
        stream = observer.observe(
            engine.generate(GenerateRequest("c", prompts["c"], SamplingParams(max_tokens=3))),
            "grpc",
        )
        streamed = [e async for e in stream]
        done = await asyncio.gather(*unary)
        # a cancelled stream: two tokens, then the client leaves
        cancelled = observer.observe(
            engine.generate(GenerateRequest("d", prompts["d"], SamplingParams(max_tokens=50))),
            "grpc",
        )
        seen = 0
        async for event in cancelled:
            seen += len(event.token_ids)
            if seen == 2:
                break
        await cancelled.aclose()  # type: ignore[attr-defined]
        with pytest.raises(InvalidRequest):
            await complete(
                observer.observe(
                    engine.generate(GenerateRequest("e", "y", SamplingParams(max_tokens=99))),
                    "rest",
                )
            )
        while engine.running():
            await asyncio.sleep(0.01)
    finally:
        engine.stop()

    prompt_tokens = {k: len(tiny_dense.tokenizer.encode(prompts[k])) for k in ("a", "b", "c")}
    assert [c.usage.generated_tokens for c in done] == [5, 7]
    assert streamed[-1].usage is not None and streamed[-1].usage.generated_tokens == 3
    assert (
        value(
            registry,
            "predictor_requests_total",
            protocol="rest",
            finish_reason="length",
            tenant="none",
        )
        == 2
    )
    assert (
        value(
            registry,
            "predictor_requests_total",
            protocol="grpc",
            finish_reason="length",
            tenant="none",
        )
        == 1
    )
    assert (
        value(
            registry,
            "predictor_requests_total",
            protocol="grpc",
            finish_reason="cancelled",
            tenant="none",
        )
        == 1
    )
    assert (
        value(
            registry,
            "predictor_requests_total",
            protocol="rest",
            finish_reason="rejected",
            tenant="none",
        )
        == 1
    )
    assert value(registry, "predictor_generation_tokens_total", tenant="none") == 5 + 7 + 3 + 2
    assert value(registry, "predictor_prompt_tokens_total", tenant="none") == sum(
        prompt_tokens.values()
    )
    # one first token per request that produced one; every later token is one TPOT sample
    assert value(registry, "predictor_time_to_first_token_seconds_count") == 4
    assert value(registry, "predictor_time_per_output_token_seconds_count") == 4 + 6 + 2 + 1
    assert value(registry, "predictor_e2e_request_latency_seconds_count") == 3
    assert value(registry, "predictor_queue_time_seconds_count") == 4
    assert value(registry, "predictor_batch_size_count") > 0
    assert value(registry, "predictor_batch_size_sum") >= 5 + 7 + 3 + 2 - 4  # decode rows
    assert value(registry, "predictor_num_requests_running") == 0
    assert value(registry, "predictor_num_requests_waiting") == 0


def test_server_counts_rest_and_grpc_alike(server) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    import httpx

    from tests.support import REPO

    def requests_total() -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
            if line.startswith("predictor_requests_total{"):
                labels, number = line.rsplit(" ", 1)
                proto = labels.split('protocol="')[1].split('"')[0]
                out[proto] = out.get(proto, 0.0) + float(number)
        return out

    before = requests_total()
    body = {"text_input": "Hi", "parameters": {"max_tokens": 2}}
    httpx.post(
        f"{server.base_url}/v2/models/tiny/generate", json=body, timeout=60
    ).raise_for_status()
    with contextlib.suppress(Exception):
        subprocess.run([sys.executable, "-m", "tests.clients.triton_grpc", server.grpc_target, "tiny", "infer"],
                       cwd=REPO, capture_output=True, timeout=120, check=True)  # fmt: skip
    after = requests_total()
    assert after.get("rest", 0) - before.get("rest", 0) == 1
    assert after.get("grpc", 0) - before.get("grpc", 0) == 2  # two prompts in one ModelInfer


async def test_kv_cache_gauge_is_exact_against_the_scheduler_under_load(tiny_dense: Tiny) -> None:
    """The gauge, read the way a scrape reads it, after every step of a run where the cache
    (not the row limit) runs dry and rows are preempted; vLLM's alias reads the same."""
    from predictor.engine.kv_cache import BlockAllocator
    from predictor.engine.scheduler import Scheduler
    from predictor.engine.step import StepStats
    from predictor.engine.step_loop import StepLoop

    block, blocks, max_tokens = 8, 20, 30  # a 160-token cache
    registry = CollectorRegistry()
    metrics = Metrics(registry, "tiny", vllm_aliases=True)
    allocator = BlockAllocator(blocks, block)
    runner = tiny_dense.runner(num_blocks=blocks, block_size=block)
    loop = StepLoop(runner, Scheduler(8, 64, allocator), frozenset())
    metrics.track_kv_cache(allocator.usage)
    samples: list[tuple[float, float, float]] = []

    def on_step(stats: StepStats) -> None:  # the step loop's thread, between two steps
        metrics.observe_step(stats)
        if not stats.running:  # the last step, or the loop stopping: nothing holds a block
            return
        held = {b for s in loop.scheduler.running for b in s.blocks}  # blocks the rows hold
        assert all(len(s.blocks) * block >= s.cached for s in loop.scheduler.running)
        gauge = value(registry, "predictor_kv_cache_usage_ratio")
        alias = registry.get_sample_value("vllm:kv_cache_usage_perc", {"model_name": "tiny"})
        samples.append((gauge, len(held) / blocks, alias or 0.0))

    engine = AsyncEngine(loop, tiny_dense.tokenizer, max_tokens_limit=64, max_prompt_tokens=100,
                         on_step=on_step)  # fmt: skip
    engine.start()
    try:
        prompts = [f"Request number {i} asks for some text" for i in range(6)]
        done = await asyncio.gather(
            *(
                complete(engine.generate(GenerateRequest(str(i), p, SamplingParams(max_tokens))))
                for i, p in enumerate(prompts)
            )
        )
    finally:
        engine.stop()
    assert all(c.usage.generated_tokens == max_tokens for c in done)
    prompt_tokens = len(tiny_dense.tokenizer.encode(prompts[0]))
    per_request = -(-(prompt_tokens + max_tokens) // block)
    assert 3 * per_request <= blocks < 6 * per_request  # the cache, not the rows, limits
    assert samples
    for gauge, exact, alias in samples:
        assert gauge == pytest.approx(exact, abs=1e-12)
        assert alias == gauge
        assert 0.0 < gauge <= 1.0
    preempted = value(registry, "predictor_num_preemptions_total")
    assert preempted > 0  # all six were admitted by their prompts and grew past the cache
    assert (
        registry.get_sample_value("vllm:num_preemptions_total", {"model_name": "tiny"}) == preempted
    )
    # under load the cache filled past half its size, and requests waited for room
    assert max(s[0] for s in samples) > 0.5


async def test_prefix_cache_counters_and_cache_config(tiny_dense: Tiny) -> None:
    """Token counters at each request's admission (vLLM's meaning: hits / queries is the
    hit rate), under our names and vLLM's, and the cache's shape for the endpoint picker."""
    registry = CollectorRegistry()
    metrics = Metrics(registry, "tiny", vllm_aliases=True)
    loop = new_loop(tiny_dense.runner(num_blocks=64, block_size=4), frozenset())
    metrics.describe_cache(4, 64, True)
    engine = AsyncEngine(loop, tiny_dense.tokenizer, max_tokens_limit=64, max_prompt_tokens=200,
                         on_step=metrics.observe_step)  # fmt: skip
    engine.start()
    document = "A shared document that every question repeats word for word. " * 3
    try:
        first = await complete(engine.generate(GenerateRequest("a", document + "One?")))
        second = await complete(engine.generate(GenerateRequest("b", document + "Two?")))
        salted = await complete(
            engine.generate(GenerateRequest("c", document + "Two?", cache_salt="other"))
        )
    finally:
        engine.stop()
    prompt = len(tiny_dense.tokenizer.encode(document + "One?"))
    assert first.usage.cached_tokens == 0 and salted.usage.cached_tokens == 0
    assert second.usage.cached_tokens >= prompt - 12 and second.usage.cached_tokens % 4 == 0
    queries = value(registry, "predictor_prefix_cache_queries_total")
    hits = value(registry, "predictor_prefix_cache_hits_total")
    total = first.usage.prompt_tokens + second.usage.prompt_tokens + salted.usage.prompt_tokens
    assert queries == total and hits == second.usage.cached_tokens
    for name, ours in (("vllm:prefix_cache_queries_total", queries),
                       ("vllm:prefix_cache_hits_total", hits)):  # fmt: skip
        assert registry.get_sample_value(name, {"model_name": "tiny"}) == ours
    labels = {"block_size": "4", "num_gpu_blocks": "64", "enable_prefix_caching": "True"}
    assert registry.get_sample_value("vllm:cache_config_info", labels) == 1
    assert registry.get_sample_value("predictor_cache_config_info", labels) == 1


def test_every_declared_collector_is_a_typed_attribute_with_its_vllm_copy() -> None:
    """METRICS is the one table: each row is an attribute `Metrics` declares with its kind (what
    mypy reads), each name is exported once, and each vLLM name only with vllm_aliases."""
    registry = CollectorRegistry()
    metrics = Metrics(registry, "tiny", vllm_aliases=True)
    declared = Metrics.__annotations__
    assert [spec.attr for spec in METRICS] == list(declared)
    for spec in METRICS:
        assert declared[spec.attr] == spec.kind.__name__
        assert type(getattr(metrics, spec.attr)) is spec.kind
    names = [spec.name for spec in METRICS] + [spec.vllm for spec in METRICS if spec.vllm]
    assert len(set(names)) == len(names)
    exported = {family.name for family in registry.collect()}
    assert {name.removesuffix("_total") for name in names} <= exported
    plain = CollectorRegistry()
    Metrics(plain, "tiny")
    assert not any(family.name.startswith("vllm:") for family in plain.collect())
