"""One exception hierarchy for the predictor. Adapters map it to status codes; nothing else does.

PredictorError
├── InvalidRequest        bad input from a client            (HTTP 400, gRPC INVALID_ARGUMENT)
├── Overloaded            waiting queue is full              (HTTP 429, gRPC RESOURCE_EXHAUSTED)
├── EngineUnavailable     engine stopped or draining         (HTTP 503, gRPC UNAVAILABLE)
├── GenerationFailed      a request failed inside the engine (HTTP 500, gRPC INTERNAL)
└── CheckpointError       a model folder that cannot be served (startup: one line, exit 2)
"""


class PredictorError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidRequest(PredictorError):
    pass


class Overloaded(PredictorError):
    pass


class EngineUnavailable(PredictorError):
    pass


class GenerationFailed(PredictorError):
    pass


class CheckpointError(PredictorError):
    pass
