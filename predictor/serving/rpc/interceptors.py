"""The interceptors on our gRPC server: undecodable messages are the client's fault, each RPC's
trace context and tenant metadata are bound for its task (`observability/context.py`), and our
errors get the status code of `errors.STATUS_TABLE` (through `serving/errors.py`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio
from kserve.protocol.grpc.interceptors import ExceptionToStatusInterceptor

from predictor.errors import PredictorError
from predictor.observability import context
from predictor.serving.errors import grpc_status

log = logging.getLogger(__name__)


class Undecodable:
    """Stands for a message that could not be parsed (see DecodeGuard)."""

    id = ""
    model_name = ""


UNDECODABLE = Undecodable()


class DecodeGuard(aio.ServerInterceptor):
    """An undecodable message is the client's fault: unary calls end INVALID_ARGUMENT (grpc
    would say INTERNAL), ModelStreamInfer answers it with a per-request error_message."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer

        def lenient(data: bytes) -> Any:
            try:
                return decode(data)
            except Exception:
                return UNDECODABLE

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if request is UNDECODABLE:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "the request message cannot be decoded"
                    )
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, lenient, handler.response_serializer)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                handler.stream_stream, lenient, handler.response_serializer
            )
        return handler


class MetaBinder(aio.ServerInterceptor):
    """Binds the RPC's `traceparent` / `tracestate` and tenant metadata while its handler runs
    (unary and streaming alike)."""

    def __init__(self, tenant_header: str) -> None:
        self.tenant_header = tenant_header.lower()

    def _meta(self, call: grpc.aio.ServicerContext) -> context.RequestMeta:
        metadata = call.invocation_metadata() or ()
        return context.read(((k, v) for k, v in metadata if isinstance(v, str)), self.tenant_header)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, call: grpc.aio.ServicerContext) -> Any:
                context.bind(self._meta(call))  # the RPC's own task: gone with it
                return await inner(request, call)

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream is not None:
            streamed = handler.stream_stream

            async def stream(requests: Any, call: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                context.bind(self._meta(call))
                async for response in streamed(requests, call):
                    yield response

            return grpc.stream_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        return handler


class StatusInterceptor(ExceptionToStatusInterceptor):
    """KServe's exception interceptor, with our errors mapped by `errors.STATUS_TABLE` (server
    faults: INTERNAL with a short message; the detail goes to the log)."""

    async def handle_exception(
        self, ex: Exception, request_or_iterator: Any, context: Any, method_name: str
    ) -> None:
        if isinstance(ex, PredictorError):
            code, message = grpc_status(ex)
            if code is grpc.StatusCode.INTERNAL:
                log.error("%s failed: %s", method_name, ex)
            await context.abort(code, message)
        await super().handle_exception(ex, request_or_iterator, context, method_name)
