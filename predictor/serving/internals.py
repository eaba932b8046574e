"""The one place that touches private or undocumented KServe (0.21) APIs.

Each item below says what we use and why no public extension point does the job; each has a
contract test in tests/serving/test_internals.py that fails naming the item when a KServe
upgrade changes what we rely on. Everything else in the package uses KServe's public API only
(`ModelServer`, `Model` with `engine = True` / `start_engine`, `DataPlane`, `InferRequest`, ...).

1. ARGV_WIPE: `kserve.model_server` parses `sys.argv` with its own argparse parser when it is
   first imported (module-level `parse_known_args`), and some of its flags (`--http_port`, ...)
   would swallow ours. `hide_argv_from_kserve` (in `serving/kserve_argv.py`, which imports no
   kserve, so `__main__` can call it before anything imports kserve) empties argv.
2. GLOBAL_APP: KServe's REST server serves the module-level FastAPI `kserve.model_server.app`
   (imported by string, `FASTAPI_APP_IMPORT_STRING`); routers, middleware and exception
   handlers can only be added by mutating that global object before the server starts
   (`install_on_app`).
3. EXCEPTION_HANDLERS: `RESTServer.create_application` registers KServe's handlers when the
   server starts, and its catch-all `Exception` handler answers 500 with the exception's type
   and text. `PredictorRESTServer.create_application` registers ours again after KServe's.
4. COPIED_GRPC_START: `GRPCServer.start` builds the `grpc.aio` server with no way to add generic
   RPC handlers (Triton's ModelStreamInfer, ModelConfig, ...), interceptors, or a host other
   than `[::]`. `PredictorGRPCServer.start` is a copy of it with those added; it reads the
   private attributes `_data_plane`, `_model_repository_extension`, `_port` and sets `_server`,
   which KServe's `stop` uses. Our status interceptor (serving/rpc/interceptors.py) subclasses
   KServe's `ExceptionToStatusInterceptor` and takes its place, so its `handle_exception` must
   exist.
5. REWRITTEN_MODEL_SERVER_START: `ModelServer.start` builds a `RESTServer` bound to 0.0.0.0 and
   a stock `GRPCServer`; `start_servers` does what it does for one worker, with our servers,
   our host (`RESTServer.config.host`), then calls the same helpers it calls
   (`_register_and_check_atleast_one_model_is_ready`, `setup_event_loop`,
   `register_signal_handler`, and our override of `_serve`), and fills `servers`,
   `_rest_server` and `_grpc_server`.
6. UVICORN_HANDLE_EXIT: uvicorn installs its own SIGINT/SIGTERM handlers while serving and stops
   at once; `RESTServer._server` (a `uvicorn.Server`) gets `handle_exit` replaced so a signal
   drains instead, and `should_exit` / `force_exit` set to stop it afterwards.
7. PRIVATE_SERVER_ATTRIBUTES: stopping the servers after a drain reads `ModelServer._rest_server`,
   `RESTServer._server` and `GRPCServer._server` (the `grpc.aio.Server`).
8. REPOSITORY_EXTENSION: `ModelServer.model_repository_extension` is replaced after `__init__`
   with one that refuses load/unload unless enabled (Triton's `--model-control-mode none`);
   KServe's gRPC servicer reads it from the private `_mode_repository_extension` and expects
   `load` / `unload` to return `{"name", "load"|"unload"}` dicts (KServe's own return None).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from fastapi import FastAPI
from grpc import aio
from kserve import ModelServer
from kserve.constants.constants import FASTAPI_APP_IMPORT_STRING
from kserve.model import BaseKServeModel
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc
from kserve.protocol.grpc.interceptors import LoggingInterceptor
from kserve.protocol.grpc.server import GRPCServer
from kserve.protocol.grpc.servicer import InferenceServicer
from kserve.protocol.model_repository_extension import ModelRepositoryExtension
from kserve.protocol.rest.server import RESTServer

ITEMS = (
    "ARGV_WIPE",
    "GLOBAL_APP",
    "EXCEPTION_HANDLERS",
    "COPIED_GRPC_START",
    "REWRITTEN_MODEL_SERVER_START",
    "UVICORN_HANDLE_EXIT",
    "PRIVATE_SERVER_ATTRIBUTES",
    "REPOSITORY_EXTENSION",
)

ExceptionHandler = Callable[[Any, Exception], Awaitable[Any]]


# 1. ARGV_WIPE: serving/kserve_argv.py ----------------------------------------------------------


# 2. GLOBAL_APP --------------------------------------------------------------------------------
def kserve_app() -> FastAPI:
    from kserve import model_server

    app = model_server.app
    assert isinstance(app, FastAPI)
    return app


def install_on_app(
    middleware: Sequence[tuple[Any, dict[str, Any]]],
    routers: Sequence[Any],
    handlers: Sequence[tuple[type[Exception], ExceptionHandler]],
) -> None:
    """Middleware (first = innermost), routers (before KServe's own) and handlers on the app."""
    app = kserve_app()
    for cls, options in middleware:
        app.add_middleware(cls, **options)
    for router in routers:
        app.include_router(router)
    for kind, handler in handlers:
        app.add_exception_handler(kind, handler)


# 3. EXCEPTION_HANDLERS ------------------------------------------------------------------------
class PredictorRESTServer(RESTServer):
    """KServe's REST server; our exception handlers win over the ones it adds at start."""

    handlers: Sequence[tuple[type[Exception], ExceptionHandler]] = ()

    def create_application(self) -> None:
        super().create_application()
        app = kserve_app()
        for kind, handler in self.handlers:
            app.add_exception_handler(kind, handler)


# 4. COPIED_GRPC_START -------------------------------------------------------------------------
class PredictorGRPCServer(GRPCServer):
    """KServe's gRPC server on our host, with extra generic handlers and interceptors."""

    def __init__(
        self,
        host: str,
        handlers: Sequence[grpc.GenericRpcHandler],
        interceptors: Sequence[aio.ServerInterceptor],
        max_message_bytes: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._host = host
        self._handlers = list(handlers)
        self._interceptors = list(interceptors)
        self._max_message_bytes = max_message_bytes

    async def start(self, max_workers: int) -> None:
        servicer = InferenceServicer(self._data_plane, self._model_repository_extension)
        self._server = aio.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            interceptors=(LoggingInterceptor(), *self._interceptors),
            options=[
                ("grpc.max_send_message_length", self._max_message_bytes),
                ("grpc.max_receive_message_length", self._max_message_bytes),
            ],
        )
        grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self._server)
        if self._handlers:
            self._server.add_generic_rpc_handlers(tuple(self._handlers))
        self._server.add_insecure_port(f"{self._host}:{self._port}")
        await self._server.start()
        await self._server.wait_for_termination()


# 5. REWRITTEN_MODEL_SERVER_START --------------------------------------------------------------
def start_servers(
    server: ModelServer,
    models: list[BaseKServeModel],
    host: str,
    rest_handlers: Sequence[tuple[type[Exception], ExceptionHandler]],
    grpc_server: Callable[[], PredictorGRPCServer] | None,
    on_signal: Callable[[int, Any], None],
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
) -> None:
    """What `ModelServer.start` does for one worker, with our servers on our host (REST over
    HTTPS where a certificate and key are given: KServe's server reloads them when renewed)."""
    server._register_and_check_atleast_one_model_is_ready(models)
    rest = PredictorRESTServer(
        FASTAPI_APP_IMPORT_STRING,
        server.dataplane,
        server.model_repository_extension,
        server.http_port,
        access_log_format=server.access_log_format,
        workers=1,
        grace_period=server.grace_period,
        event_loop=server.event_loop,
        timeout_keep_alive=server.timeout_keep_alive,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
    )
    rest.handlers = rest_handlers
    rest.config.host = host
    patch_handle_exit(rest, on_signal)
    server._rest_server = rest
    server.servers.append(rest.start())
    if grpc_server is not None:
        server._grpc_server = grpc_server()
        server.servers.append(server._grpc_server.start(server.max_threads))
    server.setup_event_loop()
    server.register_signal_handler()
    asyncio.run(server._serve())


# 6. UVICORN_HANDLE_EXIT -----------------------------------------------------------------------
def patch_handle_exit(rest: RESTServer, on_signal: Callable[[int, Any], None]) -> None:
    """uvicorn's own SIGINT/SIGTERM handlers (installed while serving) drain too."""
    rest._server.handle_exit = on_signal


# 7. PRIVATE_SERVER_ATTRIBUTES -----------------------------------------------------------------
async def stop_servers(server: ModelServer, force: bool) -> None:
    rest = getattr(server, "_rest_server", None)
    if rest is not None:
        rest._server.should_exit = True
        rest._server.force_exit = force
    grpc_server = getattr(server, "_grpc_server", None)
    if grpc_server is not None and grpc_server._server is not None:
        await grpc_server._server.stop(grace=0 if force else 5)


# 8. REPOSITORY_EXTENSION ----------------------------------------------------------------------
class GuardedRepositoryExtension(ModelRepositoryExtension):
    """Load and unload only when enabled; `refuse` raises the error that says they are off."""

    def __init__(self, registry: Any, enabled: bool, refuse: Callable[[str], Exception]) -> None:
        super().__init__(model_registry=registry)
        self.enabled = enabled
        self._refuse = refuse

    async def load(self, model_name: str) -> dict[str, Any]:
        if not self.enabled:
            raise self._refuse(model_name)
        await super().load(model_name)
        return {"name": model_name, "load": True}

    async def unload(self, model_name: str) -> dict[str, Any]:
        if not self.enabled:
            raise self._refuse(model_name)
        await super().unload(model_name)
        return {"name": model_name, "unload": True}


def install_repository_extension(server: ModelServer, extension: ModelRepositoryExtension) -> None:
    server.model_repository_extension = extension
