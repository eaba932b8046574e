"""`python -m predictor`: the only wiring point. Settings -> loader -> engine -> model -> server.

Nothing imported at the top of this module imports kserve: KServe parses sys.argv when it is
first imported, so `main` hides our flags from it before importing the adapters.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from prometheus_client import REGISTRY

from predictor import vllm_args
from predictor.config import AUTOTUNE, ServerSettings, Settings, TelemetrySettings
from predictor.engine.runners.native.bindings import build_in_background, library_cache
from predictor.engine.tool_formats import choose
from predictor.engine_assembly import build_engine
from predictor.errors import CheckpointError
from predictor.model.builds import recorded_kernel
from predictor.model.layout import resolve_checkpoint_dir, served_name
from predictor.model.loader import (
    attention_shape,
    load_checkpoint,
    load_tokenizer_only,
    pick_device,
)
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


def serving_kernel(settings: Settings, model_dir: Path) -> Settings:
    """--kernel as given, where it is given; by default (auto) the kernel the checkpoint's
    build chose (its served gate found the autotune's kernels too imprecise and this one
    within the bar: quality.json's `serve`); `autotune`: auto, whatever the build chose."""
    model = settings.model
    if model.kernel == AUTOTUNE:
        return replace(settings, model=replace(model, kernel="auto"))
    on_cpu = model.runner != "null" and pick_device(model.device).type == "cpu"
    recorded = recorded_kernel(model_dir) if model.kernel == "auto" and on_cpu else None
    if recorded is None:  # (the build chose among the CPU's kernels)
        return settings
    log.info(
        "kernel %s: chosen by the checkpoint's build (quality.json, 'serve'); "
        "--kernel autotune for the autotune's",
        recorded,
    )
    return replace(settings, model=replace(model, kernel=recorded))


def build_observer(settings: TelemetrySettings, metrics: Metrics) -> Observer:
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


def _binds(settings: ServerSettings) -> list[tuple[str, int, str]]:
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
    transfer = vllm_args.kv_transfer_config(settings.cache.kv_transfer_config)  # checked: JSON
    for line in vllm_args.kv_transfer_notes(transfer) if transfer is not None else ():
        log.warning(line)  # asked for by the deployment (KServe's kvCacheOffloading), not served
    hide_argv_from_kserve()  # KServe's import-time argv parser must see none of our flags
    os.environ["HF_HOME"] = str(settings.model.hf_home)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # What the imports made lives as long as the process: out of the collector's sight now, so
    # that the full collection gptqmodel runs after loading the checkpoint, and ours before
    # serving, walk only what the load made (a shorter start).
    gc.freeze()
    held = taken(_binds(settings.server))
    if held:
        print(f"predictor: already in use by another process: {', '.join(held)}", file=sys.stderr)
        return 2
    try:
        # KServe's storage initializer may leave the checkpoint one folder down
        model_dir = resolve_checkpoint_dir(settings.model.model_dir)
        settings = serving_kernel(settings, model_dir)
        model = settings.model
        # One thread here: only the step loop's thread runs torch in parallel (see
        # ModelRunner.bind_thread).
        if model.runner == "null":
            loaded = load_tokenizer_only(model_dir)
        else:
            if model.autotune_dir is not None and pick_device(model.device).type == "cpu":
                # the compiler runs while the checkpoint loads (a first start: seconds)
                shape = attention_shape(model_dir)
                attention = None if shape is None else (*shape, settings.cache.kv_block_size)
                build_in_background(library_cache(model.autotune_dir), attention)
            loaded = load_checkpoint(
                model_dir, model.device, threads=1, kernel=model.loader_kernel, served=True
            )
        startup.mark("load")
    except CheckpointError as exc:
        print(f"predictor: {exc}", file=sys.stderr)
        return 2

    from predictor.serving.app import PredictorServer
    from predictor.serving.errors import count_errors
    from predictor.serving.model import AdapterPredictor, LLMPredictor

    name = served_name(model.model_name, model_dir)
    metrics = Metrics(REGISTRY, name, vllm_aliases=settings.telemetry.vllm_metric_aliases)
    observer = build_observer(settings.telemetry, metrics)
    try:
        engine = build_engine(loaded, settings, metrics, startup.ready, model_dir=model_dir)
        startup.mark("engine")
        loaded = replace(loaded, model=None)  # the runner's now: a sleep must free it
    except (CheckpointError, OSError) as exc:
        print(f"predictor: {exc}", file=sys.stderr)
        return 2
    template = getattr(loaded.tokenizer, "chat_template", None)
    tool_format = choose(
        template if isinstance(template, str) else None, model.tool_call_parser or None
    )
    log.info("tool calls in the %s format", tool_format.name)
    limits = Limits(
        settings.limits.default_max_tokens,
        settings.limits.max_json_depth,
        tool_format.name,
        engine.inputs.reasoning is not None,
    )
    predictor = LLMPredictor(name, engine, limits, observer, admin=engine)
    adapters = [
        AdapterPredictor(adapter, predictor, path) for adapter, path in settings.lora.adapters
    ]
    adapters += [AdapterPredictor(alias, predictor, None) for alias in model.model_aliases]
    names = [name, *(a.name for a in adapters)]
    if len(set(names)) < len(names):
        print(
            f"predictor: the model, its other names and the LoRA adapters are named {names}: "
            "each name once",
            file=sys.stderr,
        )
        return 2
    metrics.track_sleeping(engine.is_sleeping)
    count_errors(metrics.observe_error)
    for served in (predictor, *adapters):
        served.load()
    log.info(
        "serving %s from %s on %s (kernel %s, %d threads)",
        name,
        model_dir,
        loaded.device,
        loaded.kernel,
        model.torch_threads,
    )
    server = PredictorServer(settings)
    # Everything loaded so far lives as long as the process: out of the collector's sight, so
    # that a full collection walks only what requests allocate (with the model loaded, one
    # held the GIL, and so every stream, for a pause a client sees). vLLM does the same.
    gc.collect()
    gc.freeze()
    try:
        server.start([predictor, *adapters])
    finally:
        observer.close()  # what is queued goes out (bounded waits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
