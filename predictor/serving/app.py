"""PredictorServer: KServe's ModelServer, bound to our host, with our REST and gRPC additions."""

from __future__ import annotations

import asyncio
import logging
import signal

from fastapi.exceptions import RequestValidationError
from kserve import ModelServer
from kserve.errors import ModelNotReady, ServerNotLive, ServerNotReady
from kserve.model import BaseKServeModel
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from predictor.config import Settings
from predictor.engine.client import AdapterAdmin, EngineClient
from predictor.errors import (
    EngineUnavailable,
    Forbidden,
    InvalidRequest,
    ModelMissing,
    PredictorError,
)
from predictor.serving import internals
from predictor.serving.errors import v2_response
from predictor.serving.lifecycle import Drain, PredictorDataPlane
from predictor.serving.model import AdapterPredictor, LLMPredictor
from predictor.serving.probe_logs import quiet_probes
from predictor.serving.rest import completions, health, lora, messages, oip, prefix_cache, sleep
from predictor.serving.rest.body import BodyGuard
from predictor.serving.rest.meta import RequestMetaBinder
from predictor.serving.rest.triton_admin import build_triton_router
from predictor.serving.rpc.interceptors import DecodeGuard, MetaBinder, StatusInterceptor
from predictor.serving.rpc.stream_infer import stream_handler
from predictor.serving.served import ServedModel

log = logging.getLogger(__name__)

GZIP_MINIMUM_BYTES = 500


class DefaultJSONContentType:
    """Treat an untyped POST body as JSON.

    tritonclient.http posts JSON without a Content-Type and `curl -d` labels it
    application/x-www-form-urlencoded; KServe reads both as the binary tensor extension and
    refuses them. A body that uses the binary extension says so with its own header.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = scope["headers"]
            names = {name: value for name, value in headers}
            untyped = names.get(b"content-type", b"application/x-www-form-urlencoded")
            if (
                untyped.startswith(b"application/x-www-form-urlencoded")
                and b"inference-header-content-length" not in names
            ):
                kept = [(n, v) for n, v in headers if n != b"content-type"]
                scope = dict(scope, headers=[*kept, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


async def predictor_error_handler(request: Request, exc: Exception) -> Response:
    """Our errors raised through KServe's own routes (V2 infer): 429 with Retry-After, etc."""
    assert isinstance(exc, PredictorError)
    return v2_response(exc)


async def validation_error_handler(request: Request, exc: Exception) -> Response:
    """FastAPI's body validation (KServe's /infer) as 422 with {"error": ...}, not {"detail"}."""
    assert isinstance(exc, RequestValidationError)
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
        for e in exc.errors()[:3]
    )
    return v2_response(InvalidRequest(f"invalid request body: {problems}"), status=422)


async def not_ready_handler(request: Request, exc: Exception) -> Response:
    """KServe's health answers (not ready, not live, model not ready): 503 with {"error": ...}.
    A state, not a fault: KServe's own handlers log each with a traceback, and probes ask every
    few seconds while the server starts, drains or stalls."""
    log.debug("%s %s: %s", request.method, request.url.path, exc)
    return v2_response(EngineUnavailable(str(exc)))


async def server_fault_handler(request: Request, exc: Exception) -> Response:
    """Anything unexpected: 500 with a short message; the detail goes to the log only."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return v2_response(exc)


def forbidden(model_name: str) -> Exception:
    return Forbidden(
        f"loading and unloading models is disabled (model '{model_name}'); start the server "
        "with --model-control true to allow it"
    )


class PredictorServer(ModelServer):
    def __init__(self, settings: Settings) -> None:
        super().__init__(
            http_port=settings.server.http_port,
            grpc_port=settings.server.grpc_port,
            workers=1,  # one engine per process: scale with replicas, not workers
            enable_grpc=settings.server.enable_grpc,
            grace_period=settings.server.drain_seconds,
        )
        self.settings = settings
        self.host = settings.server.host
        self.dataplane = PredictorDataPlane(model_registry=self.registered_models)
        internals.install_repository_extension(
            self,
            internals.GuardedRepositoryExtension(
                self.registered_models, settings.server.model_control, forbidden
            ),
        )
        self.drain = Drain(self.dataplane, self._engines, settings.server.drain_seconds, self._stop)

    def _engines(self) -> list[EngineClient]:
        return [m.llm for m in self.served_models()]

    async def _stop(self, force: bool) -> None:
        await internals.stop_servers(self, force)

    def register_signal_handler(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.drain.on_signal)

    async def _serve(self) -> None:
        self.drain.attach(asyncio.get_running_loop())
        await asyncio.gather(*self.servers)

    def served_model(self, name: str) -> ServedModel | None:
        """The registered model of that name, if it is one of ours (it has an engine)."""
        model = self.registered_models.get_model(name)
        return model if isinstance(model, ServedModel) else None

    def model_names(self) -> list[str]:
        return list(self.registered_models.get_models())

    def served_models(self) -> list[ServedModel]:
        models = self.registered_models.get_models().values()
        return [m for m in models if isinstance(m, ServedModel)]

    async def _load_adapter(self, name: str, path: str) -> None:
        """A LoRA adapter loaded at run time, then served as a model of its own name."""
        if self.registered_models.get_model(name) is not None:
            raise InvalidRequest(f"a model named '{name}' is already served", "lora_name")
        base = self._base_model()
        await self._admin(base).load_adapter(name, path)
        adapter = AdapterPredictor(name, base, path)
        adapter.load()
        self.registered_models.update(adapter)

    async def _unload_adapter(self, name: str) -> None:
        """Its name unserved at once; its weights freed once no request uses them."""
        model = self.served_model(name)
        if not isinstance(model, AdapterPredictor) or model.lineage is None:
            raise ModelMissing(f"LoRA adapter '{name}' is not loaded")
        await self._admin(self._base_model()).unload_adapter(name)
        self.registered_models.unload(name)  # an adapter: nothing of the engine stops

    async def _reset_prefix_cache(self) -> bool:
        return await self._base_model().llm.reset_prefix_cache()

    async def _sleep(self) -> None:
        await self._base_model().llm.sleep()

    async def _wake_up(self) -> None:
        await self._base_model().llm.wake_up()

    def _sleeping(self) -> bool:
        return self._base_model().llm.is_sleeping()

    def _base_model(self) -> LLMPredictor:
        """The model the adapters adapt (the one that runs the engine)."""
        for model in self.served_models():
            if isinstance(model, LLMPredictor) and model.engine:
                return model
        raise ModelMissing("no model is served")

    @staticmethod
    def _admin(base: LLMPredictor) -> AdapterAdmin:
        if base.admin is None:
            raise InvalidRequest("this server serves no LoRA adapters")
        return base.admin

    def _build_grpc_server(self) -> internals.PredictorGRPCServer:
        handler = stream_handler(
            self.served_model,
            self.served_models,
            self.settings.limits.max_stream_requests,
            self.settings.limits.stream_queue_size,
            self.settings.limits.slow_reader_grace,
        )
        return internals.PredictorGRPCServer(
            self.host,
            [handler],
            [DecodeGuard(), MetaBinder(self.settings.telemetry.tenant_header), StatusInterceptor()],
            self.settings.limits.max_body_bytes,
            self.grpc_port,
            self.dataplane,
            self.model_repository_extension,
            kwargs={},
            grace_period=self.grace_period,
        )

    def start(self, models: list[BaseKServeModel]) -> None:
        settings = self.settings
        limits = settings.limits
        quiet_probes()
        handlers: list[tuple[type[Exception], internals.ExceptionHandler]] = [
            (PredictorError, predictor_error_handler),
            (RequestValidationError, validation_error_handler),
            (ServerNotReady, not_ready_handler),
            (ServerNotLive, not_ready_handler),
            (ModelNotReady, not_ready_handler),
            (Exception, server_fault_handler),
        ]
        internals.install_on_app(
            middleware=[  # innermost first
                (
                    BodyGuard,
                    {"max_bytes": limits.max_body_bytes, "max_depth": limits.max_json_depth},
                ),
                (DefaultJSONContentType, {}),
                # Unary JSON is compressed for clients that accept it; Starlette never
                # compresses text/event-stream, so streams are not held back.
                (GZipMiddleware, {"minimum_size": GZIP_MINIMUM_BYTES}),
                (RequestMetaBinder, {"tenant_header": settings.telemetry.tenant_header}),
            ],
            routers=[
                oip.build_router(self.served_model),
                # before KServe registers its own routes: ours answer GET /v1/models in both
                completions.build_router(self.served_model, self.model_names),
                messages.build_router(self.served_model),
                build_triton_router(self.served_model, self.served_models),
                health.build_router(self.dataplane),
                lora.build_router(
                    settings.lora.allow_runtime_lora, self._load_adapter, self._unload_adapter
                ),
                prefix_cache.build_router(self._reset_prefix_cache),
                sleep.build_router(
                    settings.model.enable_sleep_mode, self._sleep, self._wake_up, self._sleeping
                ),
            ],
            handlers=handlers,
        )
        internals.start_servers(
            self,
            models,
            self.host,
            handlers,
            self._build_grpc_server if self.enable_grpc else None,
            self.drain.on_signal,
            settings.server.ssl_certfile or None,
            settings.server.ssl_keyfile or None,
        )
