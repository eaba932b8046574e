"""Triton's `ModelStreamInfer` (and, through `stream_handler`, the RPCs of `triton_admin.py`),
served beside KServe's servicer on the same gRPC server.

Several requests may share one stream; each runs concurrently and its responses carry its `id`.
Every response has the bool parameter `triton_final_response`; a request that sets
`triton_enable_empty_final_response` ends with an empty response flagged final. A bad request
gets `error_message` and the stream stays open for the others. Cancelling the call aborts
every request on it.

A stream buffers at most `queue_size` (`--stream-queue-size`) responses for its reader. A request
whose next token does not fit, and still does not after `grace` (`--slow-reader-grace`), is
cancelled (its row is freed at the next step) and ends with a `RESOURCE_EXHAUSTED` error_message
once the reader makes room: the engine cannot pause a row, so waiting would only move the
backlog into the request's engine queue, unbounded while the row keeps generating. Final
responses (nothing more to generate) wait for room, one per request at most. So a client that
stops reading holds at most `queue_size` responses, one final per request
(`--max-stream-requests`) and gRPC's flow-control window, and no rows; the step loop only ever
appends to queues, and other streams are unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from kserve import InferRequest
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb

from predictor.errors import SERVER_FAULT, InvalidRequest, Overloaded, PredictorError
from predictor.pb import triton_model_pb2 as tpb
from predictor.pb.model_stream_infer_pb2 import ModelStreamInferResponse
from predictor.protocols.triton import requests as v2_requests
from predictor.protocols.triton import responses as v2_responses
from predictor.protocols.v2 import plain_parameters
from predictor.serving.errors import grpc_status
from predictor.serving.rpc.interceptors import Undecodable
from predictor.serving.rpc.triton_admin import TritonStatusServicer
from predictor.serving.served import Models, Resolve, ready_model
from predictor.serving.streaming import emitted, first_event, one_prompt, whole

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"


class StreamInferServicer:
    def __init__(
        self, resolve: Resolve, max_requests: int = 64, queue_size: int = 256, grace: float = 1.0
    ) -> None:
        self._resolve = resolve
        self._max_requests = max_requests
        self._queue_size = queue_size
        self._grace = grace  # seconds a token response may wait for room in a full queue

    async def model_stream_infer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[ModelStreamInferResponse]:
        # bounded: a reader that falls behind gets its requests cancelled (see the docstring)
        out: asyncio.Queue[ModelStreamInferResponse | None] = asyncio.Queue(self._queue_size)
        running: set[asyncio.Task[None]] = set()

        async def read() -> None:
            async for request in requests:
                if len(running) >= self._max_requests:
                    busy = Overloaded(
                        f"RESOURCE_EXHAUSTED: {len(running)} requests already in progress on "
                        f"this stream; the limit is {self._max_requests}"
                    )
                    await out.put(error(request, str(busy)))
                    continue
                task = asyncio.create_task(self._serve(request, out))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:
                await asyncio.gather(*list(running), return_exceptions=True)
            await out.put(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await out.get()) is not None:
                yield response
        finally:  # the call ended or was cancelled: abort whatever still runs
            reader.cancel()
            for task in list(running):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(reader, *running, return_exceptions=True)

    async def _serve(self, request: pb.ModelInferRequest, out: asyncio.Queue[Any]) -> None:
        try:
            await self._answer(request, out)
        except PredictorError as exc:
            await out.put(error(request, grpc_status(exc)[1]))
        except Exception:  # every request gets an answer, whatever went wrong
            log.exception("ModelStreamInfer request %r failed", request.id)
            await out.put(error(request, SERVER_FAULT))

    async def _answer(self, request: pb.ModelInferRequest, out: asyncio.Queue[Any]) -> None:
        if isinstance(request, Undecodable):
            raise InvalidRequest("the request message cannot be decoded")
        model = ready_model(self._resolve, request.model_name)
        try:
            v2 = InferRequest.from_grpc(request)
        except Exception as exc:  # an unknown datatype, contents that do not fit the shape
            raise InvalidRequest(f"not a valid inference request: {exc}") from exc
        decoded = v2_requests.decode_infer_request(v2, model.limits, streaming=True)
        req = one_prompt(decoded.requests, "ModelStreamInfer")
        empty_final = bool(plain_parameters(request.parameters).get(EMPTY_FINAL))
        events = model.stream(req, "grpc")
        if not decoded.stream:
            events = whole(events, lambda c: v2_responses.whole_event(decoded, c))
        try:
            every_token = v2_responses.wants_every_token(decoded)
            async for event in emitted(await first_event(events), events, every_token):
                if event.error is not None:
                    await out.put(error(request, event.error))
                    return
                response = v2_responses.encode_stream_response(v2, model.name, decoded, event)
                message = stream_response(response.to_grpc(), event.final and not empty_final)
                if event.final:  # nothing left to generate: wait for room
                    await out.put(message)
                else:
                    await self._offer(out, message)
                if event.final and empty_final:
                    await out.put(empty_final_response(request, model.name))
        finally:
            await events.aclose()

    async def _offer(self, out: asyncio.Queue[Any], message: ModelStreamInferResponse) -> None:
        """Queue a token response, or raise Overloaded (cancelling the request) when the reader
        leaves the queue full for longer than the grace."""
        if not out.full():  # the common case, without a timer
            out.put_nowait(message)
            return
        try:
            async with asyncio.timeout(self._grace):
                await out.put(message)
        except TimeoutError:
            raise Overloaded(
                f"RESOURCE_EXHAUSTED: the client is not reading this stream: "
                f"{self._queue_size} responses are waiting (--stream-queue-size); "
                "the request is cancelled"
            ) from None


def stream_response(response: pb.ModelInferResponse, final: bool) -> ModelStreamInferResponse:
    response.parameters[FINAL].bool_param = final
    return ModelStreamInferResponse(infer_response=response)


def empty_final_response(
    request: pb.ModelInferRequest, model_name: str
) -> ModelStreamInferResponse:
    response = pb.ModelInferResponse(id=request.id, model_name=model_name)
    response.parameters[FINAL].bool_param = True
    return ModelStreamInferResponse(infer_response=response)


def error(request: pb.ModelInferRequest, message: str) -> ModelStreamInferResponse:
    response = pb.ModelInferResponse(id=request.id, model_name=request.model_name)
    response.parameters[FINAL].bool_param = True
    return ModelStreamInferResponse(error_message=message, infer_response=response)


def stream_handler(
    resolve: Resolve,
    models: Models,
    max_requests: int = 64,
    queue_size: int = 256,
    grace: float = 1.0,
) -> grpc.GenericRpcHandler:
    """Triton's RPCs that KServe's servicer lacks (it registers only its own method names, so
    lookups of these fall through to this handler)."""
    servicer = StreamInferServicer(resolve, max_requests, queue_size, grace)
    status = TritonStatusServicer(resolve, models)
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                servicer.model_stream_infer,
                request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=ModelStreamInferResponse.SerializeToString,
            ),
            "ModelConfig": grpc.unary_unary_rpc_method_handler(
                status.model_config,
                request_deserializer=tpb.ModelConfigRequest.FromString,
                response_serializer=tpb.ModelConfigResponse.SerializeToString,
            ),
            "ModelStatistics": grpc.unary_unary_rpc_method_handler(
                status.model_statistics,
                request_deserializer=tpb.ModelStatisticsRequest.FromString,
                response_serializer=tpb.ModelStatisticsResponse.SerializeToString,
            ),
            "RepositoryIndex": grpc.unary_unary_rpc_method_handler(
                status.repository_index,
                request_deserializer=tpb.RepositoryIndexRequest.FromString,
                response_serializer=tpb.RepositoryIndexResponse.SerializeToString,
            ),
        },
    )
