"""One exception hierarchy for the predictor, and the one table that maps it to status codes.

PredictorError
├── InvalidRequest        bad input from a client            (HTTP 400, gRPC INVALID_ARGUMENT)
│   │                     `param` names the offending field when one is to blame (OpenAI's)
│   └── BodyTooLarge      a body past --max-body-bytes       (HTTP 413, gRPC RESOURCE_EXHAUSTED)
├── Forbidden             an operation switched off by flag  (HTTP 403, gRPC PERMISSION_DENIED)
├── ModelMissing          no model of that name              (HTTP 404, gRPC NOT_FOUND)
│   └── VersionMissing    a model version that is not served
├── Overloaded            waiting queue (or a limit) is full (HTTP 429, gRPC RESOURCE_EXHAUSTED)
├── EngineUnavailable     engine stopped or draining         (HTTP 503, gRPC UNAVAILABLE)
├── GenerationFailed      a request failed inside the engine (HTTP 500, gRPC INTERNAL)
└── CheckpointError       a model folder that cannot be served (startup: one line, exit 2)
    └── UnsupportedModel  a model family the runner has no forward pass for

NativeUnavailable (a RuntimeError, never shown to a client): a C kernel that cannot be built or
loaded here; the runner falls back to torch.

Adapters turn an error into a status with `status_of` and nothing else; the renderers of each
transport are in `serving/errors.py`. Any other exception is a server fault: 500 / INTERNAL with
`SERVER_FAULT` as the message, the detail in the log only.
"""

from __future__ import annotations

from dataclasses import dataclass


class PredictorError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidRequest(PredictorError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the field to blame, as OpenAI's error `param` names it


class BodyTooLarge(InvalidRequest):
    pass


class Forbidden(PredictorError):
    pass


class ModelMissing(PredictorError):
    pass


class VersionMissing(ModelMissing):
    pass


class Overloaded(PredictorError):
    pass


class EngineUnavailable(PredictorError):
    pass


class GenerationFailed(PredictorError):
    pass


class CheckpointError(PredictorError):
    pass


class UnsupportedModel(CheckpointError):
    pass


class NativeUnavailable(RuntimeError):
    """A native kernel that cannot be compiled or loaded here (the torch path serves)."""


SERVER_FAULT = "internal server error (see the server log)"


@dataclass(frozen=True)
class Status:
    http: int
    grpc: str  # the name of a grpc.StatusCode member (this module imports no grpc)
    client_fault: bool  # the message is the client's to read; else it is SERVER_FAULT
    reason: str  # the error's kind on /metrics (predictor_request_errors_total{reason})


# most specific first: the first class the error is an instance of decides
STATUS_TABLE: tuple[tuple[type[PredictorError], Status], ...] = (
    (BodyTooLarge, Status(413, "RESOURCE_EXHAUSTED", True, "body_too_large")),
    (InvalidRequest, Status(400, "INVALID_ARGUMENT", True, "invalid_request")),
    (Forbidden, Status(403, "PERMISSION_DENIED", True, "forbidden")),
    (ModelMissing, Status(404, "NOT_FOUND", True, "model_missing")),
    (Overloaded, Status(429, "RESOURCE_EXHAUSTED", True, "overloaded")),
    (EngineUnavailable, Status(503, "UNAVAILABLE", True, "engine_unavailable")),
    (GenerationFailed, Status(500, "INTERNAL", True, "generation_failed")),
)
SERVER_FAULT_STATUS = Status(500, "INTERNAL", False, "internal")


def status_of(exc: BaseException) -> Status:
    for kind, status in STATUS_TABLE:
        if isinstance(exc, kind):
            return status
    return SERVER_FAULT_STATUS


def message_of(exc: BaseException) -> str:
    """What the client reads: our own message, or SERVER_FAULT (never an exception's text)."""
    return str(exc) if status_of(exc).client_fault else SERVER_FAULT
