"""Settings: the groups by concern, read once from CLI flags and PREDICTOR_* variables by one
parser, whose --help has a section per group (as vLLM's config classes and its argument
groups)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from predictor import vllm_args
from predictor.config.engine import (
    CacheSettings,
    LoraSettings,
    SchedulerSettings,
    SpeculationSettings,
)
from predictor.config.model import ModelSettings
from predictor.config.serving import LimitsSettings, ServerSettings, TelemetrySettings

# OpenTelemetry's standard variables, read when our own flag and PREDICTOR_* variable are unset
OTEL_ENV = {
    "otlp_traces_endpoint": ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    "otlp_traces_protocol": ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
}


@dataclass(frozen=True)
class Settings:
    """Every setting, in its group; a flag's name is its field's, whatever its group."""

    model: ModelSettings = field(default_factory=ModelSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)

    @classmethod
    def from_sources(cls, argv: Sequence[str], env: Mapping[str, str]) -> Settings:
        """Parse CLI flags; each flag's default comes from PREDICTOR_<NAME> or the field default.
        ValueError (its message names the flags) where the values cannot be served together."""
        ns = build_parser(env).parse_args(list(argv))
        ns.model_aliases = (*ns.served_aliases, *ns.model_aliases)
        groups = {
            name: kind(**{f.name: _value(getattr(ns, f.name)) for f in fields(kind)})
            for name, kind in GROUPS.items()
        }
        settings = cls(**groups)
        settings.check()
        return settings

    def check(self) -> None:
        """Each group's own check, then what concerns two groups."""
        for name in GROUPS:
            getattr(self, name).check()
        if self.model.sleeps and self.lora.served:
            raise ValueError(
                "--sleep-idle-seconds and --enable-sleep-mode serve no LoRA "
                "adapters (--lora-modules, --allow-runtime-lora)"
            )


# the groups by their Settings field, in --help's order
GROUPS: dict[str, Any] = {f.name: f.default_factory for f in fields(Settings)}


def _value(value: Any) -> Any:
    """A parsed flag's value as its field holds it: a list flag's values as a tuple."""
    return tuple(value) if isinstance(value, list) else value


def _otel_default(name: str, env: Mapping[str, str], default: str) -> str:
    """OpenTelemetry's own variable for this setting. The generic OTEL_EXPORTER_OTLP_ENDPOINT
    is a base URL: over http/protobuf the traces go to its /v1/traces (the specification)."""
    specific, generic = OTEL_ENV[name]
    if env.get(specific):
        return env[specific]
    value = env.get(generic, "")
    if not value:
        return default
    if name == "otlp_traces_endpoint" and _otel_default("otlp_traces_protocol", env, "grpc") != (
        "grpc"
    ):
        return value.rstrip("/") + "/v1/traces"
    return value


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The parser of every flag, a --help section per group (its docstring's line), then
    vLLM's flags that have no setting of their own; defaults from `env`'s PREDICTOR_*."""
    parser = vllm_args.Parser(
        prog="python -m predictor",
        description="Serve a GPTQ model over KServe's V2 REST and gRPC protocols.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    for name, kind in GROUPS.items():
        section = parser.add_argument_group(name, (kind.__doc__ or "").strip())
        for option in fields(kind):
            _add_flag(parser, section, option, env)
    vllm_args.add_arguments(parser.add_argument_group("vllm", vllm_args.SECTION))
    return parser


def _add_flag(
    parser: argparse.ArgumentParser, section: vllm_args.Flags, option: Any, env: Mapping[str, str]
) -> None:
    """One field's flag in its section: `--NAME` and vLLM's names for it, its default from
    `PREDICTOR_NAME` where set (a usage error naming it where it is not of the field's type)."""
    flag = "--" + option.name.replace("_", "-")
    env_name = "PREDICTOR_" + option.name.upper()
    default = option.default
    kind = type(default)
    convert = vllm_args.boolean if kind is bool else str if kind is tuple else kind
    many = "*" if kind is tuple else None  # a list flag: its values, space-separated
    if env_name not in env and option.name in OTEL_ENV:
        default = _otel_default(option.name, env, default)
    if env_name in env:
        try:
            default = tuple(env[env_name].split()) if many else convert(env[env_name])
        except (ValueError, argparse.ArgumentTypeError):
            parser.error(f"{env_name}={env[env_name]!r} is not a valid {kind.__name__}")
    names = (flag, *vllm_args.FLAG_ALIASES.get(option.name, ()))  # vLLM's names too
    note = f"[env {env_name}]"
    help = option.metadata["help"]
    if kind is bool:  # --flag, --no-flag, --flag VALUE
        vllm_args.add_boolean(section, names, option.name, default, help, note)
        return
    section.add_argument(
        *names,
        dest=option.name,
        type=convert,
        nargs=many,
        default=default,
        choices=option.metadata["choices"],
        help=f"{help} {note}",
    )
