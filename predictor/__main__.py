"""`python -m predictor`: the only wiring point. Settings -> loader -> engine -> model -> server."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from predictor.settings import Settings

log = logging.getLogger("predictor")


def build_engine(loaded: object, settings: Settings) -> object:
    """Runner, scheduler and step loop behind the asyncio front."""
    from predictor.engine.async_engine import AsyncEngine
    from predictor.engine.runner import ModelRunner
    from predictor.engine.scheduler import Scheduler
    from predictor.engine.step_loop import StepLoop
    from predictor.model.loader import LoadedModel

    assert isinstance(loaded, LoadedModel)
    runner = ModelRunner(loaded.model, loaded.device, loaded.pad_token_id)
    scheduler = Scheduler(settings.max_batch_size, settings.max_cache_tokens, settings.max_waiting)
    step_loop = StepLoop(runner, scheduler, loaded.eos_ids)
    max_prompt = settings.max_prompt_tokens or max(
        1, loaded.context_length - settings.max_tokens_limit
    )
    return AsyncEngine(
        step_loop,
        loaded.tokenizer,
        max_tokens_limit=settings.max_tokens_limit,
        max_prompt_tokens=max_prompt,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = Settings.from_sources(sys.argv[1:] if argv is None else argv, os.environ)
    # KServe parses sys.argv when it is imported: let it see none of our flags.
    sys.argv = sys.argv[:1]
    os.environ["HF_HOME"] = str(settings.hf_home)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from predictor.errors import CheckpointError
    from predictor.model.loader import load_checkpoint

    try:
        loaded = load_checkpoint(settings.model_dir, settings.device, settings.torch_threads)
    except CheckpointError as exc:
        print(f"predictor: {exc}", file=sys.stderr)
        return 2

    from predictor.engine.async_engine import AsyncEngine
    from predictor.kserve_model import LLMPredictor
    from predictor.server.app import PredictorServer

    engine = build_engine(loaded, settings)
    assert isinstance(engine, AsyncEngine)
    predictor = LLMPredictor(settings.served_model_name, engine, settings.default_max_tokens)
    predictor.load()
    log.info(
        "serving %s from %s on %s (kernel %s, %d threads)",
        settings.served_model_name,
        settings.model_dir,
        loaded.device,
        loaded.kernel,
        settings.torch_threads,
    )
    server = PredictorServer(
        host=settings.host,
        http_port=settings.http_port,
        grpc_port=settings.grpc_port,
        enable_grpc=settings.enable_grpc,
    )
    server.start([predictor])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
