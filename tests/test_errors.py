"""One table maps every error to its HTTP status and gRPC code; server faults never leak text."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_interceptor.exceptions import GrpcException

from predictor import errors
from predictor.serving.errors import (
    grpc_status,
    kserve_error,
    openai_body,
    openai_response,
    v2_response,
)

CASES = [
    (errors.InvalidRequest("bad"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.BodyTooLarge("big"), 413, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Forbidden("off"), 403, grpc.StatusCode.PERMISSION_DENIED),
    (errors.ModelMissing("who"), 404, grpc.StatusCode.NOT_FOUND),
    (errors.Overloaded("busy"), 429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.EngineUnavailable("draining"), 503, grpc.StatusCode.UNAVAILABLE),
    (errors.GenerationFailed("forward pass failed"), 500, grpc.StatusCode.INTERNAL),
    (RuntimeError("secret detail"), 500, grpc.StatusCode.INTERNAL),
    (KeyError("secret detail"), 500, grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize(("exc", "http", "code"), CASES)
def test_every_adapter_uses_the_table(exc: Exception, http: int, code: grpc.StatusCode) -> None:
    rest = v2_response(exc)
    assert rest.status_code == http
    assert openai_response(exc).status_code == http
    assert grpc_status(exc)[0] == code
    grpc_error = kserve_error(exc, from_grpc=True)
    assert isinstance(grpc_error, GrpcException) and grpc_error.status_code == code
    if not isinstance(exc, errors.PredictorError):  # a server fault: a short message only
        assert json.loads(bytes(rest.body))["error"] == errors.SERVER_FAULT
        assert "secret" not in grpc_error.details and "secret" not in grpc_status(exc)[1]
        assert "secret" not in json.dumps(openai_body(exc))
    else:
        assert json.loads(bytes(rest.body))["error"] == str(exc)


def test_overloaded_says_when_to_retry() -> None:
    assert v2_response(errors.Overloaded("busy")).headers["retry-after"] == "1"
