"""`python -m predictor`: the only wiring point. Settings -> loader -> engine -> model -> server.

Nothing imported at the top of this module imports kserve: KServe parses sys.argv when it is
first imported, so `main` hides our flags from it before importing the adapters.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from predictor import vllm_args
from predictor.config import AUTOTUNE, FUSED_KERNELS, Settings
from predictor.engine.adapters import Adapters
from predictor.engine.async_engine import AsyncEngine
from predictor.engine.kv_cache import BlockAllocator, blocks_for
from predictor.engine.kv_events import BlockHasher, Recorder
from predictor.engine.kv_offload import ROOT_SEED, Offload
from predictor.engine.kv_publisher import ZmqPublisher
from predictor.engine.reasoning import choose_format
from predictor.engine.runners.memory import trim_heap
from predictor.engine.runners.model import ModelRunner
from predictor.engine.runners.native import build_in_background, library_cache
from predictor.engine.runners.null import NullRunner
from predictor.engine.scheduler import Scheduler
from predictor.engine.sleep import Sleep
from predictor.engine.speculation import Policy, Proposer, SpeculationConfig
from predictor.engine.step import Runner
from predictor.engine.step_loop import StepLoop
from predictor.engine.tool_formats import choose
from predictor.errors import CheckpointError
from predictor.model.builds import recorded_kernel
from predictor.model.layout import resolve_checkpoint_dir, served_name
from predictor.model.loader import (
    LoadedModel,
    attention_shape,
    load_checkpoint,
    load_tokenizer_only,
    pick_device,
)
from predictor.model.lora import Adapter, reading_adapter
from predictor.observability.metrics import Metrics
from predictor.observability.observer import Observer
from predictor.observability.payloads import PayloadLog
from predictor.observability.startup import StartupClock
from predictor.observability.tenants import TenantLabels
from predictor.observability.tracing import start_tracing
from predictor.protocols.limits import Limits
from predictor.serving.kserve_argv import hide_argv_from_kserve
from predictor.serving.ports import taken

log = logging.getLogger("predictor")
# at shutdown, of the ~40 s KServe leaves after preStop: writing the cached blocks to disk
OFFLOAD_SAVE_SECONDS = 20.0


def serving_kernel(settings: Settings, model_dir: Path) -> Settings:
    """--kernel as given, where it is given; by default (auto) the kernel the checkpoint's
    build chose (its served gate found the autotune's kernels too imprecise and this one
    within the bar: quality.json's `serve`); `autotune`: auto, whatever the build chose."""
    if settings.kernel == AUTOTUNE:
        return replace(settings, kernel="auto")
    on_cpu = settings.runner != "null" and pick_device(settings.device).type == "cpu"
    recorded = recorded_kernel(model_dir) if settings.kernel == "auto" and on_cpu else None
    if recorded is None:  # (the build chose among the CPU's kernels)
        return settings
    log.info("kernel %s: chosen by the checkpoint's build (quality.json, 'serve'); "
             "--kernel autotune for the autotune's", recorded)  # fmt: skip
    return replace(settings, kernel=recorded)


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
    publisher, events = _kv_events(settings, metrics)
    allocator = BlockAllocator(
        blocks_for(settings.max_cache_tokens, settings.kv_block_size),
        settings.kv_block_size,
        evictions=events,
    )
    runner: Runner
    if settings.runner == "null":
        vocab = len(loaded.tokenizer)
        runner = NullRunner(vocab, allocator.num_blocks, allocator.block_size, max_rows=256)
    elif loaded.device.type == "cuda":
        runner = _cuda_runner(loaded, settings, allocator)
    else:
        runner = _cpu_runner(loaded.model, loaded.device, settings, allocator, invariant)
    offload = _kv_offload(settings, runner, allocator, events, metrics)
    sleep = _sleep(settings, loaded, allocator, invariant, model_dir, offload)
    speculation = None
    if settings.speculative != "off":
        config = SpeculationConfig(settings.speculative, settings.num_speculative_tokens)
        cost = None
        if hasattr(runner, "step_cost"):  # the runner of the moment's (a sleep replaces it)

            def cost(fed: int, rows: int) -> float | None:
                return getattr(step_loop.runner, "step_cost", lambda *_: None)(fed, rows)

        speculation = (Proposer(config), Policy(cost))
    scheduler = Scheduler(
        settings.max_batch_size,
        settings.max_waiting,
        allocator,
        max_step_tokens=settings.max_step_tokens,
        prefix_caching=settings.prefix_caching,
        speculation=speculation,
        max_loras=settings.max_loras,
        events=events,
        offload=offload,
    )
    step_loop = StepLoop(runner, scheduler, loaded.eos_ids, on_prepared=on_prepared,
                         vocab=len(loaded.tokenizer), sleep=sleep)  # fmt: skip
    # LoRA adapters are the runner's, which a sleep drops: a sleeping engine serves none
    adapters = None if sleep is not None else _adapters(settings, runner, step_loop.run_chore)
    metrics.describe_cache(allocator.block_size, allocator.num_blocks, settings.prefix_caching)
    # the KV-cache gauge: the share of the cache's blocks holding tokens now (vLLM's
    # kv_cache_usage_perc); one integer read at each scrape, never blocking the step loop
    metrics.track_kv_cache(allocator.usage)
    max_prompt = settings.max_prompt_tokens or max(
        1, loaded.context_length - settings.max_tokens_limit
    )
    return AsyncEngine(
        step_loop,
        loaded.tokenizer,
        max_tokens_limit=settings.max_tokens_limit,
        max_prompt_tokens=max_prompt,
        default_timeout=settings.request_timeout or None,
        max_prompts=settings.max_prompts,
        stall_seconds=settings.stall_seconds,
        grammar_timeout=settings.grammar_compile_timeout,
        max_grammar_compiles=settings.max_grammar_compiles,
        on_step=metrics.observe_step,
        adapters=adapters,
        on_stop=_on_stop(publisher, offload, allocator, step_loop),
        reasoning=choose_format(loaded.tokenizer, settings.reasoning_parser),
        reasoning_budget=None if settings.reasoning_budget < 0 else settings.reasoning_budget,
    )


def _hash_seed(settings: Settings) -> str | None:
    """vLLM's NONE_HASH seed: read here, at the edge (the router must be given the same); with
    the disk cache a fixed one where it is unset (a restart must compute the same hashes)."""
    seed = os.environ.get("PYTHONHASHSEED")
    return ROOT_SEED if seed is None and settings.kv_offload_dir else seed


def _kv_offload(
    settings: Settings,
    runner: Runner,
    allocator: BlockAllocator,
    events: Recorder | None,
    metrics: Metrics,
) -> Offload | None:
    """The prefix cache on disk where --kv-offload-dir turns it on (the CPU runner's); the
    allocator told to spill into it."""
    if not settings.kv_offload_dir:
        return None
    if not isinstance(runner, ModelRunner):
        raise CheckpointError("--kv-offload-dir needs the CPU runner (not the GPU's or null)")
    hasher = events.hasher if events is not None else BlockHasher(
        allocator.block_size, settings.prefix_caching_hash_algo, _hash_seed(settings)
    )  # fmt: skip
    offload = Offload.open(
        Path(settings.kv_offload_dir),
        int(settings.kv_offload_size * 2**30),
        resolve_checkpoint_dir(settings.model_dir),
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
            threads=settings.torch_threads,
            attention=settings.attention,
            kernel=settings.kernel if settings.kernel in FUSED_KERNELS else "auto",
            autotune_cache=settings.autotune_dir,
            release_model_weights=True,  # only the runner runs the served model
            batch_invariant=invariant,
            copies_after_ready=True,  # ready sooner; many-row steps at speed soon after
            lora=bool(settings.lora_modules or settings.allow_runtime_lora),
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
    if model_dir is None or not (settings.sleep_idle_seconds > 0 or settings.enable_sleep_mode):
        return None
    if settings.runner != "null" and loaded.device.type == "cuda":
        raise CheckpointError("sleep frees the CPU runner's model: not on a GPU "
                              "(--sleep-idle-seconds, --enable-sleep-mode)")  # fmt: skip
    vocab = len(loaded.tokenizer)

    def reload() -> Runner:
        if settings.runner == "null":
            return NullRunner(vocab, allocator.num_blocks, allocator.block_size, max_rows=256)
        again = load_checkpoint(model_dir, settings.device, threads=settings.torch_threads,
                                kernel=settings.kernel, served=True)  # fmt: skip
        runner = _cpu_runner(again.model, again.device, settings, allocator, invariant)
        if offload is not None:
            offload.copies = runner
        return runner

    def keep() -> None:
        if offload is not None:
            saved = offload.save(allocator.cached_blocks(), timeout=OFFLOAD_SAVE_SECONDS)
            log.info("KV disk cache: %d cached blocks saved before the sleep", saved)

    return Sleep(reload, _free_runner, _release_memory, settings.sleep_idle_seconds, keep)


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


def _kv_events(settings: Settings, metrics: Metrics) -> tuple[ZmqPublisher | None, Recorder | None]:
    """The KV events' publisher (its sockets open: OSError where they cannot) and recorder,
    where --kv-events-config turns them on; else none, and nothing of them runs."""
    config = settings.kv_events
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
    seed = _hash_seed(settings)
    recorder = Recorder(
        publisher.publish, settings.kv_block_size, settings.prefix_caching_hash_algo, seed
    )
    if os.environ.get("PYTHONHASHSEED") is None:
        log.warning("PYTHONHASHSEED is not set: the KV events' block hashes are seeded at "
                    "%s, so no router can compute them (vLLM's rule)",
                    "random" if seed is None else "this server's own seed")  # fmt: skip
    return publisher, recorder


def _adapters(
    settings: Settings, runner: Runner, run_chore: Callable[[Generator[None, None, Any]], Any]
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
        adapter: Adapter = run_chore(reading_adapter(
            name, Path(path), lora.shapes, lora.layers, settings.max_lora_rank
        ))  # fmt: skip
        log.info("LoRA adapter %s (rank %d) from %s", name, adapter.rank, path)
        return adapter

    adapters = Adapters(
        read,
        lambda slot, a: run_chore(runner.adding_adapter(slot, a.factors, a.scale)),
        lora.remove,
        limit=settings.max_cpu_loras,
    )
    for name, path in settings.adapters:
        adapters.load(name, path)
    return adapters


def _cuda_runner(loaded: LoadedModel, settings: Settings, allocator: BlockAllocator) -> Runner:
    """The GPU's runner (imported only here: it imports Triton)."""
    from predictor.engine.runners.cuda.runner import CudaRunner

    if settings.attention == "native":
        raise CheckpointError("--attention native is the CPU's: on a GPU use triton, torch or auto")
    return CudaRunner(  # UnsupportedModel is a CheckpointError
        loaded.model,
        loaded.device,
        allocator.num_blocks,
        allocator.block_size,
        max_rows=settings.max_batch_size,
        max_step_tokens=settings.max_step_tokens,
        graphs=settings.cuda_graphs,
        attention=settings.attention,
        release_model_weights=True,  # only the runner runs the served model
    )


def build_observer(settings: Settings, metrics: Metrics) -> Observer:
    """Metrics always; traces and payload records when configured (their threads start here)."""
    tracing = None
    if settings.otlp_traces_endpoint:
        tracing = start_tracing(
            settings.otlp_traces_endpoint, settings.otlp_traces_protocol, metrics.spans_dropped.inc
        )
    payloads = None
    if settings.log_payloads != "off":
        payloads = PayloadLog(
            settings.payload_logger_url,
            settings.log_payloads,
            f"/models/{metrics.model_name}",
            metrics.payloads_dropped.inc,
        )
    return Observer(metrics, TenantLabels(settings.max_tenant_labels), tracing, payloads)


def _binds(settings: Settings) -> list[tuple[str, int, str]]:
    """What the server will listen on: REST on --host, gRPC on every address (KServe's)."""
    binds = [(settings.host, settings.http_port, "the REST port")]
    if settings.enable_grpc:
        binds.append(("::", settings.grpc_port, "the gRPC port"))
    return binds


def main(argv: Sequence[str] | None = None) -> int:
    startup = StartupClock()
    startup.mark("imports")
    try:
        settings = Settings.from_sources(sys.argv[1:] if argv is None else argv, os.environ)
    except ValueError as exc:  # a setting that cannot be served: said in one line, exit 2
        print(f"predictor: {exc}", file=sys.stderr)
        return 2
    # our INFO lines (kernel choices, memory, readiness) on stderr: configured here, at the edge
    # (they once appeared only because importing gptqmodel configures the root logger)
    logging.basicConfig(level=logging.INFO)
    transfer = vllm_args.kv_transfer_config(settings.kv_transfer_config)  # checked: JSON
    for line in vllm_args.kv_transfer_notes(transfer) if transfer is not None else ():
        log.warning(line)  # asked for by the deployment (KServe's kvCacheOffloading), not served
    hide_argv_from_kserve()  # KServe's import-time argv parser must see none of our flags
    os.environ["HF_HOME"] = str(settings.hf_home)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # What the imports made lives as long as the process: out of the collector's sight now, so
    # that the full collection gptqmodel runs after loading the checkpoint, and ours before
    # serving, walk only what the load made (0.33 + 0.36 s -> 0.17 s of a start, Zen 5).
    gc.freeze()
    held = taken(_binds(settings))
    if held:
        print(f"predictor: already in use by another process: {', '.join(held)}", file=sys.stderr)
        return 2
    try:
        # KServe's storage initializer may leave the checkpoint one folder down
        model_dir = resolve_checkpoint_dir(settings.model_dir)
        settings = serving_kernel(settings, model_dir)
        # One thread here: only the step loop's thread runs torch in parallel (see
        # ModelRunner.bind_thread).
        if settings.runner == "null":
            loaded = load_tokenizer_only(model_dir)
        else:
            if settings.autotune_dir is not None and pick_device(settings.device).type == "cpu":
                # the compiler runs while the checkpoint loads (a first start: seconds)
                shape = attention_shape(model_dir)
                attention = None if shape is None else (*shape, settings.kv_block_size)
                build_in_background(library_cache(settings.autotune_dir), attention)
            loaded = load_checkpoint(model_dir, settings.device, threads=1,
                                     kernel=settings.kernel, served=True)  # fmt: skip
        startup.mark("load")
    except CheckpointError as exc:
        print(f"predictor: {exc}", file=sys.stderr)
        return 2

    from predictor.serving.app import PredictorServer
    from predictor.serving.errors import count_errors
    from predictor.serving.model import AdapterPredictor, LLMPredictor

    name = served_name(settings.model_name, model_dir)
    metrics = Metrics(REGISTRY, name, vllm_aliases=settings.vllm_metric_aliases)
    observer = build_observer(settings, metrics)
    try:
        engine = build_engine(loaded, settings, metrics, startup.ready, model_dir=model_dir)
        startup.mark("engine")
        loaded = replace(loaded, model=None)  # the runner's now: a sleep must free it
    except (CheckpointError, OSError) as exc:
        print(f"predictor: {exc}", file=sys.stderr)
        return 2
    template = getattr(loaded.tokenizer, "chat_template", None)
    tool_format = choose(template if isinstance(template, str) else None,
                         settings.tool_call_parser or None)  # fmt: skip
    log.info("tool calls in the %s format", tool_format.name)
    limits = Limits(settings.default_max_tokens, settings.max_json_depth, tool_format.name,
                    engine.inputs.reasoning is not None)  # fmt: skip
    predictor = LLMPredictor(name, engine, limits, observer)
    adapters = [AdapterPredictor(adapter, predictor, path) for adapter, path in settings.adapters]
    adapters += [AdapterPredictor(alias, predictor, None) for alias in settings.model_aliases]
    names = [name, *(a.name for a in adapters)]
    if len(set(names)) < len(names):
        print(f"predictor: the model, its other names and the LoRA adapters are named {names}: "
              "each name once", file=sys.stderr)  # fmt: skip
        return 2
    metrics.track_sleeping(engine.is_sleeping)
    count_errors(metrics.observe_error)
    for model in (predictor, *adapters):
        model.load()
    log.info(
        "serving %s from %s on %s (kernel %s, %d threads)",
        name, model_dir, loaded.device, loaded.kernel, settings.torch_threads,
    )  # fmt: skip
    server = PredictorServer(settings)
    # Everything loaded so far lives as long as the process: out of the collector's sight, so
    # that a full collection walks only what requests allocate (measured here with the model
    # loaded: gc.collect() held the GIL, and so every stream, for 153 ms). vLLM does the same.
    gc.collect()
    gc.freeze()
    try:
        server.start([predictor, *adapters])
    finally:
        observer.close()  # what is queued goes out (bounded waits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
