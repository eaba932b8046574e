"""Settings: read once, at the edge, from CLI flags and PREDICTOR_* environment variables.

This package is the only code that looks at argv or the environment; everything else receives
a `Settings` (or the group, or the few values, it needs) as arguments. Its modules, one concern
each: `settings` (Settings, the groups gathered, and the parser), `model`, `serving` (server,
limits, telemetry) and `engine` (cache, scheduler, speculation, LoRA): the groups, each with its
own check; `flags` (what makes a field a flag, and the named choices). A leaf: it imports no
engine, model or server code.
"""

from predictor.config.engine import (
    CacheSettings,
    LoraSettings,
    SchedulerSettings,
    SpeculationSettings,
)
from predictor.config.flags import (
    ATTENTION,
    AUTOTUNE,
    FUSED_KERNELS,
    HASH_ALGOS,
    KERNELS,
    LOADER_KERNELS,
    NATIVE_ISAS,
    NATIVE_KERNELS,
    OTLP_PROTOCOLS,
    PAYLOAD_MODES,
    REASONING_PARSERS,
    RUNNER_KERNELS,
    SPECULATIVE,
    TOOL_CALL_PARSERS,
)
from predictor.config.model import DEFAULT_MODEL_DIR, SERVING_CORES, ModelSettings
from predictor.config.serving import LimitsSettings, ServerSettings, TelemetrySettings
from predictor.config.settings import GROUPS, OTEL_ENV, Settings, build_parser

__all__ = [
    "ATTENTION",
    "AUTOTUNE",
    "DEFAULT_MODEL_DIR",
    "FUSED_KERNELS",
    "GROUPS",
    "HASH_ALGOS",
    "KERNELS",
    "LOADER_KERNELS",
    "NATIVE_ISAS",
    "NATIVE_KERNELS",
    "RUNNER_KERNELS",
    "OTEL_ENV",
    "OTLP_PROTOCOLS",
    "PAYLOAD_MODES",
    "REASONING_PARSERS",
    "SERVING_CORES",
    "SPECULATIVE",
    "TOOL_CALL_PARSERS",
    "CacheSettings",
    "LimitsSettings",
    "LoraSettings",
    "ModelSettings",
    "SchedulerSettings",
    "ServerSettings",
    "Settings",
    "SpeculationSettings",
    "TelemetrySettings",
    "build_parser",
]
