"""PredictorServer: KServe's ModelServer, bound to our host, with our REST and gRPC additions."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from kserve import ModelServer
from kserve.constants.constants import FASTAPI_APP_IMPORT_STRING
from kserve.model import BaseKServeModel
from kserve.model_server import app as kserve_app
from kserve.protocol.grpc.server import GRPCServer
from kserve.protocol.rest.server import RESTServer
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from predictor.engine.client import EngineClient
from predictor.errors import PredictorError
from predictor.server import openai
from predictor.server.grpc import stream_handler
from predictor.server.lifecycle import Drain, DrainingDataPlane
from predictor.server.rest import ServedModel, build_router, error_response
from predictor.server.triton import build_triton_router

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
    return error_response(exc)


async def validation_error_handler(request: Request, exc: Exception) -> Response:
    """FastAPI's body validation (KServe's /infer) as 422 with {"error": ...}, not {"detail"}."""
    assert isinstance(exc, RequestValidationError)
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
        for e in exc.errors()[:3]
    )
    return JSONResponse({"error": f"invalid request body: {problems}"}, status_code=422)


class PredictorGRPCServer(GRPCServer):
    """KServe's gRPC server on our host, with extra generic handlers on the same port."""

    def __init__(self, host: str, handlers: Sequence[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._host = host
        self._handlers = list(handlers)

    async def start(self, max_workers: int) -> None:
        from concurrent import futures

        from grpc import aio
        from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc
        from kserve.protocol.grpc.interceptors import (
            ExceptionToStatusInterceptor,
            LoggingInterceptor,
        )
        from kserve.protocol.grpc.servicer import InferenceServicer

        servicer = InferenceServicer(self._data_plane, self._model_repository_extension)
        self._server = aio.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            interceptors=(LoggingInterceptor(), ExceptionToStatusInterceptor()),
            options=[
                ("grpc.max_send_message_length", self._kwargs.get("grpc_max_send_message_length")),
                (
                    "grpc.max_receive_message_length",
                    self._kwargs.get("grpc_max_receive_message_length"),
                ),
            ],
        )
        grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self._server)
        if self._handlers:
            self._server.add_generic_rpc_handlers(tuple(self._handlers))
        self._server.add_insecure_port(f"{self._host}:{self._port}")
        await self._server.start()
        await self._server.wait_for_termination()


class PredictorServer(ModelServer):
    def __init__(
        self,
        host: str,
        http_port: int,
        grpc_port: int,
        enable_grpc: bool = True,
        grace_period: int = 30,
    ) -> None:
        super().__init__(
            http_port=http_port,
            grpc_port=grpc_port,
            workers=1,  # one engine per process: scale with replicas, not workers
            enable_grpc=enable_grpc,
            grace_period=grace_period,
        )
        self.host = host
        self.dataplane = DrainingDataPlane(model_registry=self.registered_models)
        self.drain = Drain(self.dataplane, self._engines, grace_period, self._stop_servers)

    def _engines(self) -> list[EngineClient]:
        return [m.llm for m in self.served_models()]

    async def _stop_servers(self, force: bool) -> None:
        if self._rest_server is not None:
            uvicorn_server = self._rest_server._server
            uvicorn_server.should_exit = True
            uvicorn_server.force_exit = force
        if self._grpc_server is not None and self._grpc_server._server is not None:
            await self._grpc_server._server.stop(grace=0 if force else 5)

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

    def start(self, models: list[BaseKServeModel]) -> None:
        self._register_and_check_atleast_one_model_is_ready(models)
        kserve_app.add_middleware(DefaultJSONContentType)
        # Unary JSON is compressed for clients that accept it; Starlette never compresses
        # text/event-stream, so streams are not held back.
        kserve_app.add_middleware(GZipMiddleware, minimum_size=GZIP_MINIMUM_BYTES)
        kserve_app.include_router(build_router(self.served_model))
        # before KServe registers its own routes: ours answer GET /v1/models in both shapes
        kserve_app.include_router(openai.build_router(self.served_model, self.model_names))
        kserve_app.include_router(build_triton_router(self.served_model, self.served_models))
        kserve_app.add_exception_handler(PredictorError, predictor_error_handler)
        kserve_app.add_exception_handler(RequestValidationError, validation_error_handler)
        self._rest_server = RESTServer(
            FASTAPI_APP_IMPORT_STRING,
            self.dataplane,
            self.model_repository_extension,
            self.http_port,
            access_log_format=self.access_log_format,
            workers=1,
            grace_period=self.grace_period,
            event_loop=self.event_loop,
            timeout_keep_alive=self.timeout_keep_alive,
        )
        self._rest_server.config.host = self.host
        # uvicorn installs its own SIGINT/SIGTERM handlers while serving: make them drain too
        self._rest_server._server.handle_exit = self.drain.on_signal
        self.servers.append(self._rest_server.start())
        if self.enable_grpc:
            self._grpc_server = PredictorGRPCServer(
                self.host,
                [stream_handler(self.served_model, self.served_models)],
                self.grpc_port,
                self.dataplane,
                self.model_repository_extension,
                kwargs={
                    "grpc_max_send_message_length": 64 * 1024 * 1024,
                    "grpc_max_receive_message_length": 64 * 1024 * 1024,
                },
                grace_period=self.grace_period,
            )
            self.servers.append(self._grpc_server.start(self.max_threads))
        self.setup_event_loop()
        self.register_signal_handler()
        asyncio.run(self._serve())
