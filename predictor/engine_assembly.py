"""The engine assembled from the settings and the loaded model: the runner (CPU, GPU or null),
the KV cache and its events and disk copy, the scheduler with speculation, the step loop, LoRA
adapters, sleep, behind the asyncio front. `python -m predictor` (__main__.py) calls
`build_engine` once; the load/ benchmarks call it in process. No server framework here.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from predictor.config import FUSED_KERNELS, CacheSettings, LoraSettings, Settings
from predictor.engine.adapters import Adapters
from predictor.engine.async_engine import AsyncEngine
from predictor.engine.drafting import Speculation
from predictor.engine.kv_cache import BlockAllocator, blocks_for
from predictor.engine.kv_events import BlockHasher, Recorder
from predictor.engine.kv_offload import ROOT_SEED, Offload
from predictor.engine.kv_publisher import ZmqPublisher
from predictor.engine.reasoning import choose_format
from predictor.engine.runners.cpu import ModelRunner
from predictor.engine.runners.memory import trim_heap
from predictor.engine.runners.null import NullRunner
from predictor.engine.scheduler import Scheduler
from predictor.engine.sleep import Sleep
from predictor.engine.speculation import Policy, Proposer, SpeculationConfig
from predictor.engine.step import Runner
from predictor.engine.step_loop import StepLoop
from predictor.errors import CheckpointError
from predictor.model.layout import resolve_checkpoint_dir
from predictor.model.loader import LoadedModel, load_checkpoint
from predictor.model.lora import Adapter, reading_adapter
from predictor.observability.metrics import Metrics

log = logging.getLogger("predictor")
# at shutdown, of the ~40 s KServe leaves after preStop: writing the cached blocks to disk
OFFLOAD_SAVE_SECONDS = 20.0


def build_engine(
    loaded: LoadedModel,
    settings: Settings,
    metrics: Metrics,
    on_prepared: Callable[[], None] | None = None,
    invariant: bool = True,
    model_dir: Path | None = None,
) -> AsyncEngine:
    """Runner, scheduler and step loop behind the asyncio front. `invariant`: always, but for
    load/bench_invariance.py's baseline (a request's tokens independent of its batch: the CPU
    runner's `batch_invariant`). `model_dir`: where the checkpoint is read again after a sleep
    (--sleep-idle-seconds, --enable-sleep-mode; without it the engine never sleeps)."""
    cache, limits = settings.cache, settings.limits
    publisher, events = _kv_events(cache, metrics)
    blocks = blocks_for(cache.max_cache_tokens, cache.kv_block_size)
    allocator = BlockAllocator(blocks, cache.kv_block_size, evictions=events)
    runner: Runner
    if settings.model.runner == "null":
        vocab = len(loaded.tokenizer)
        runner = NullRunner(vocab, allocator.num_blocks, allocator.block_size, max_rows=256)
    elif loaded.device.type == "cuda":
        runner = _cuda_runner(loaded, settings, allocator)
    else:
        runner = _cpu_runner(loaded.model, loaded.device, settings, allocator, invariant)
    offload = _kv_offload(settings, runner, allocator, events, metrics)
    sleep = _sleep(settings, loaded, allocator, invariant, model_dir, offload)
    speculation = None
    if settings.speculation.speculative != "off":
        drafts = settings.speculation
        config = SpeculationConfig(drafts.speculative, drafts.num_speculative_tokens)
        cost = None
        if hasattr(runner, "step_cost"):  # the runner of the moment's (a sleep replaces it)

            def cost(fed: int, rows: int) -> float | None:
                return getattr(step_loop.runner, "step_cost", lambda *_: None)(fed, rows)

        speculation = Speculation(Proposer(config), Policy(cost))
    scheduler = Scheduler(
        settings.scheduler.max_batch_size,
        settings.scheduler.max_waiting,
        allocator,
        max_step_tokens=settings.scheduler.max_step_tokens,
        prefix_caching=cache.prefix_caching,
        speculation=speculation,
        max_loras=settings.lora.max_loras,
        events=events,
        offload=offload,
    )
    step_loop = StepLoop(
        runner,
        scheduler,
        loaded.eos_ids,
        on_prepared=on_prepared,
        vocab=len(loaded.tokenizer),
        sleep=sleep,
    )
    # LoRA adapters are the runner's, which a sleep drops: a sleeping engine serves none
    adapters = None if sleep is not None else _adapters(settings.lora, runner, step_loop.run_chore)
    metrics.describe_cache(allocator.block_size, allocator.num_blocks, cache.prefix_caching)
    # the KV-cache gauge: the share of the cache's blocks holding tokens now (vLLM's
    # kv_cache_usage_perc), as the step loop last published it: read at each scrape, never
    # blocking the step loop
    metrics.track_kv_cache(lambda: step_loop.status().kv_usage)
    max_prompt = limits.max_prompt_tokens or max(1, loaded.context_length - limits.max_tokens_limit)
    budget = settings.model.reasoning_budget
    return AsyncEngine(
        step_loop,
        loaded.tokenizer,
        max_tokens_limit=limits.max_tokens_limit,
        max_prompt_tokens=max_prompt,
        default_timeout=limits.request_timeout or None,
        max_prompts=limits.max_prompts,
        stall_seconds=limits.stall_seconds,
        grammar_timeout=limits.grammar_compile_timeout,
        max_grammar_compiles=limits.max_grammar_compiles,
        on_step=metrics.observe_step,
        adapters=adapters,
        on_stop=_on_stop(publisher, offload, allocator, step_loop),
        reasoning=choose_format(loaded.tokenizer, settings.model.reasoning_parser),
        reasoning_budget=None if budget < 0 else budget,
    )


def _hash_seed(cache: CacheSettings) -> str | None:
    """vLLM's NONE_HASH seed: read here, at the edge (the router must be given the same); with
    the disk cache a fixed one where it is unset (a restart must compute the same hashes)."""
    seed = os.environ.get("PYTHONHASHSEED")
    return ROOT_SEED if seed is None and cache.kv_offload_dir else seed


def _kv_offload(
    settings: Settings,
    runner: Runner,
    allocator: BlockAllocator,
    events: Recorder | None,
    metrics: Metrics,
) -> Offload | None:
    """The prefix cache on disk where --kv-offload-dir turns it on (the CPU runner's); the
    allocator told to spill into it."""
    cache = settings.cache
    if not cache.kv_offload_dir:
        return None
    if not isinstance(runner, ModelRunner):
        raise CheckpointError("--kv-offload-dir needs the CPU runner (not the GPU's or null)")
    hasher = (
        events.hasher
        if events is not None
        else BlockHasher(allocator.block_size, cache.prefix_caching_hash_algo, _hash_seed(cache))
    )
    offload = Offload.open(
        Path(cache.kv_offload_dir),
        int(cache.kv_offload_size * 2**30),
        resolve_checkpoint_dir(settings.model.model_dir),
        hasher,
        runner,
    )
    allocator.spill = offload
    metrics.track_kv_offload(lambda: offload.counts, lambda: offload.store.used)
    return offload


def _on_stop(
    publisher: ZmqPublisher | None,
    offload: Offload | None,
    allocator: BlockAllocator,
    step_loop: StepLoop,
) -> Callable[[], None] | None:
    """What runs once the step loop stopped: the events' publisher closed, the cached blocks
    saved to disk (only where the loop's thread is gone: no step may run meanwhile)."""
    if publisher is None and offload is None:
        return None

    def stop() -> None:
        if publisher is not None:
            publisher.stop()
        if offload is not None and not step_loop.alive():
            saved = offload.save(allocator.cached_blocks(), timeout=OFFLOAD_SAVE_SECONDS)
            log.info("KV disk cache: %d cached blocks saved at shutdown", saved)

    return stop


def _cpu_runner(
    model: Any, device: Any, settings: Settings, allocator: BlockAllocator, invariant: bool
) -> ModelRunner:
    """The CPU runner of `model` (at the start, and again at each wake from a sleep)."""
    try:
        return ModelRunner(  # UnsupportedModel is a CheckpointError
            model,
            device,
            allocator.num_blocks,
            allocator.block_size,
            threads=settings.model.torch_threads,
            attention=settings.model.attention,
            kernel=settings.model.kernel if settings.model.kernel in FUSED_KERNELS else "auto",
            autotune_cache=settings.model.autotune_dir,
            release_model_weights=True,  # only the runner runs the served model
            batch_invariant=invariant,
            copies_after_ready=True,  # ready sooner; many-row steps at speed soon after
            lora=settings.lora.served,
            copy_budget=settings.model.copy_budget,
        )
    except ValueError as exc:  # a forced kernel this CPU cannot run
        raise CheckpointError(str(exc)) from exc


def _sleep(
    settings: Settings,
    loaded: LoadedModel,
    allocator: BlockAllocator,
    invariant: bool,
    model_dir: Path | None,
    offload: Offload | None,
) -> Sleep | None:
    """How the engine sleeps, where --sleep-idle-seconds or --enable-sleep-mode ask it to: a
    wake reads the checkpoint again (from the page cache, mostly) and builds the runner as the
    start did, its kernels' choices, libraries and layouts from the autotune's cache. With the
    disk cache, the prefix cache's blocks are saved before the sleep empties it (the wake finds
    them there) and the disk cache copies from the new runner's pools."""
    if model_dir is None or not settings.model.sleeps:
        return None
    if settings.model.runner != "null" and loaded.device.type == "cuda":
        raise CheckpointError(
            "sleep frees the CPU runner's model: not on a GPU "
            "(--sleep-idle-seconds, --enable-sleep-mode)"
        )
    vocab = len(loaded.tokenizer)

    def reload() -> Runner:
        if settings.model.runner == "null":
            return NullRunner(vocab, allocator.num_blocks, allocator.block_size, max_rows=256)
        model = settings.model
        again = load_checkpoint(
            model_dir,
            model.device,
            threads=model.torch_threads,
            kernel=model.loader_kernel,
            served=True,
        )
        runner = _cpu_runner(again.model, again.device, settings, allocator, invariant)
        if offload is not None:
            offload.copies = runner
        return runner

    def keep() -> None:
        if offload is not None:
            saved = offload.save(allocator.cached_blocks(), timeout=OFFLOAD_SAVE_SECONDS)
            log.info("KV disk cache: %d cached blocks saved before the sleep", saved)

    return Sleep(reload, _free_runner, _release_memory, settings.model.sleep_idle_seconds, keep)


def _free_runner(runner: Runner) -> None:
    if isinstance(runner, ModelRunner):
        runner.free()


def _release_memory() -> None:
    """What a sleep dropped, back to the system: the model and runner were frozen out of the
    collector's sight at the start (`main`), so what only cycles keep is found by unfreezing
    once; then the heap's free pages go (glibc's malloc_trim)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    trim_heap()


def _kv_events(
    cache: CacheSettings, metrics: Metrics
) -> tuple[ZmqPublisher | None, Recorder | None]:
    """The KV events' publisher (its sockets open: OSError where they cannot) and recorder,
    where --kv-events-config turns them on; else none, and nothing of them runs."""
    config = cache.kv_events
    if config is None or not config.publishing:
        return None, None
    publisher = ZmqPublisher(
        config.endpoint,
        config.replay_endpoint,
        config.topic,
        config.buffer_steps,
        config.hwm,
        config.max_queue_size,
        on_drop=metrics.kv_events_dropped.inc,
    )
    publisher.start()
    seed = _hash_seed(cache)
    recorder = Recorder(
        publisher.publish, cache.kv_block_size, cache.prefix_caching_hash_algo, seed
    )
    if os.environ.get("PYTHONHASHSEED") is None:
        log.warning(
            "PYTHONHASHSEED is not set: the KV events' block hashes are seeded at "
            "%s, so no router can compute them (vLLM's rule)",
            "random" if seed is None else "this server's own seed",
        )
    return publisher, recorder


def _adapters(
    settings: LoraSettings, runner: Runner, run_chore: Callable[[Generator[None, None, Any]], Any]
) -> Adapters | None:
    """The LoRA adapters (the CPU runner's), --lora-modules read, checked against the model and
    made resident; an adapter that cannot be served stops the start (AdapterError, its
    reason). None where the runner serves none."""
    if not isinstance(runner, ModelRunner):
        if settings.lora_modules:
            raise CheckpointError("--lora-modules needs the CPU runner (not the GPU's or null)")
        return None
    lora = runner.lora

    # read and laid out a slice at a time on the step loop's thread, between steps (at the
    # start, before it runs: here at once); StepLoop.run_chore says why
    def read(name: str, path: str) -> Adapter:
        adapter: Adapter = run_chore(
            reading_adapter(name, Path(path), lora.shapes, lora.layers, settings.max_lora_rank)
        )
        log.info("LoRA adapter %s (rank %d) from %s", name, adapter.rank, path)
        return adapter

    adapters = Adapters(
        read,
        lambda slot, a: run_chore(runner.adding_adapter(slot, a.factors, a.scale)),
        lora.remove,
        limit=settings.max_cpu_loras,
        max_loras=settings.max_loras,
    )
    for name, path in settings.adapters:
        adapters.load(name, path)
    return adapters


def _cuda_runner(loaded: LoadedModel, settings: Settings, allocator: BlockAllocator) -> Runner:
    """The GPU's runner (imported only here: it imports Triton)."""
    from predictor.engine.runners.cuda.runner import CudaRunner

    if settings.model.attention == "native":
        raise CheckpointError("--attention native is the CPU's: on a GPU use triton, torch or auto")
    return CudaRunner(  # UnsupportedModel is a CheckpointError
        loaded.model,
        loaded.device,
        allocator.num_blocks,
        allocator.block_size,
        max_rows=settings.scheduler.max_batch_size,
        max_step_tokens=settings.scheduler.max_step_tokens,
        graphs=settings.model.cuda_graphs,
        attention=settings.model.attention,
        release_model_weights=True,  # only the runner runs the served model
    )
