"""`vllm serve`'s spellings of this server's settings: what a deployment written for vLLM passes
(KServe's LLMInferenceService templates its engine command and appends its LoRA, tracing and KV
offloading flags), read into the same Settings (config/settings.py builds the parser and calls
these). A boolean flag is written as vLLM writes its own (argparse.BooleanOptionalAction):
`--flag` alone, `--no-flag`.

KServe's preset (config/llmisvcconfig/config-llm-template.yaml, kserve/kserve) runs
`vllm serve /mnt/models --served-model-name NAME publishers/NS/models/NAME --port 8000
--disable-uvicorn-access-log [--shutdown-timeout S] [--kv-transfer-config JSON]
[--enable-ssl-refresh --ssl-certfile F --ssl-keyfile F] $VLLM_ADDITIONAL_ARGS $@`, where $@ holds
`--enable-lora [--max-lora-rank=N] [--max-loras=N] [--max-cpu-loras=N] --lora-modules JSON...`
and `--otlp-traces-endpoint URL --collect-detailed-traces all`: every word of it is taken here."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

# --help's section of the flags add_arguments adds
SECTION = "vLLM's flags with no setting of their own (each says what it does here)"


class Flags(Protocol):
    """Where flags are added: a parser, or one section (argument group) of its --help."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action: ...

    def set_defaults(self, **kwargs: Any) -> None: ...


# Settings fields also set by vLLM's flag of another name
FLAG_ALIASES = {
    "http_port": ("--port",),
    "prefix_caching": ("--enable-prefix-caching",),  # and --no-enable-prefix-caching
    "kv_block_size": ("--block-size",),
    # vLLM >= 0.18: seconds requests in flight may take after SIGTERM (KServe passes the pod's
    # grace period less its preStop pause and 5 s: 40 with the preset's 60 and 15)
    "drain_seconds": ("--shutdown-timeout",),
}
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def boolean(text: str) -> bool:
    """A boolean flag's value or PREDICTOR_* variable: a word of TRUE_WORDS or FALSE_WORDS."""
    if text.lower() in TRUE_WORDS:
        return True
    if text.lower() in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(
        f"not a boolean: {text!r} (a value is one of {'/'.join(TRUE_WORDS)}, "
        f"{'/'.join(FALSE_WORDS)}; the flag alone is true, --no-FLAG false)"
    )


def add_boolean(
    parser: Flags,
    names: Sequence[str],
    dest: str,
    default: bool,
    help: str,
    note: str = "",
) -> None:
    """A boolean flag under each of `names`: alone it is true, as `--no-NAME` false (vLLM's
    forms), and `--flag VALUE` / `--flag=VALUE` takes a word of `boolean`'s (this server's first
    form, in deployments still). A bare flag takes the next argument only when that does not
    start with '-' (argparse's nargs='?'), so `--flag --port 1` is the flag alone and `--flag
    port` an error naming the word. `--no-NAME` takes no value; it is left out of --help, where
    the flag's own line names it, before `note`."""
    negated = ["--no-" + name.removeprefix("--") for name in names]
    parser.add_argument(
        *names,
        dest=dest,
        nargs="?",
        const=True,
        type=boolean,
        default=default,
        metavar="BOOL",
        help=f"{help} ({' or '.join(negated)}: false) {note}".rstrip(),
    )
    parser.add_argument(
        *negated, dest=dest, action="store_false", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )


class Parser(argparse.ArgumentParser):
    """vLLM's `vllm serve MODEL [FLAGS]`: a first word that is not a flag is the model folder,
    as --model-dir (a later --model-dir counts instead, as with any flag given twice). Anywhere
    else a word that no flag takes is an error, as before."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if args is not None and args and not args[0].startswith("-"):
            args = ["--model-dir", args[0], *args[1:]]
        return super().parse_known_args(args, namespace)


def add_arguments(parser: Flags) -> None:
    """vLLM's flags with no Settings field of their own."""
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        action=_ServedNames,
        help="vLLM's: the model's name (--model-name), then other names it answers to "
        "(--model-aliases)",
    )
    parser.set_defaults(served_aliases=())
    # vLLM's switch for serving adapters: this server serves them without it
    add_boolean(
        parser, ["--enable-lora"], "enable_lora", False, "vLLM's; adapters need no switch here"
    )
    # vLLM's switch for tool_choice "auto" (beside --tool-call-parser): always served here
    add_boolean(
        parser,
        ["--enable-auto-tool-choice"],
        "enable_auto_tool_choice",
        False,
        "vLLM's; tool_choice auto needs no switch here",
    )
    # KServe's preset passes these; each has no effect here, and says why
    add_boolean(
        parser,
        ["--disable-uvicorn-access-log"],
        "disable_uvicorn_access_log",
        False,
        "vLLM's; probes and scrapes are logged at DEBUG here, other requests at INFO",
    )
    parser.add_argument(
        "--disable-access-log-for-endpoints",
        metavar="PATHS",
        help="vLLM's (comma-separated paths); probes and scrapes are logged at DEBUG here",
    )
    add_boolean(
        parser,
        ["--enable-ssl-refresh"],
        "enable_ssl_refresh",
        False,
        "vLLM's; the certificate and key are always read again when renewed here",
    )
    parser.add_argument(
        "--collect-detailed-traces",
        metavar="MODULES",
        help="vLLM's (model, worker, all); a request's span carries its latencies here",
    )


class _ServedNames(argparse.Action):
    """vLLM's --served-model-name NAME [NAME ...]: the model's name, then the others (before
    --model-aliases', in Settings.from_sources)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        namespace.model_name = values[0]
        namespace.served_aliases = tuple(values[1:])


LORA_MODULE_KEYS = ("name", "path", "base_model_name")  # vLLM's LoRAModulePath


def lora_module(entry: str) -> tuple[str, str]:
    """A --lora-modules entry as (name, path): `NAME=PATH`, or vLLM's JSON form `{"name": NAME,
    "path": PATH, "base_model_name": BASE}` (the base is optional and only informative in vLLM:
    an adapter here is always of the served model). Another key is refused, as vLLM refuses it."""
    if entry.startswith("{"):
        try:
            spec = json.loads(entry)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: {entry!r} is not JSON ({exc})") from exc
        name, path = (spec.get("name"), spec.get("path")) if isinstance(spec, dict) else (0, 0)
        unknown = sorted(set(spec) - set(LORA_MODULE_KEYS)) if isinstance(spec, dict) else []
        if unknown:
            raise ValueError(
                f"--lora-modules: {entry!r} has unknown key(s) {', '.join(unknown)} "
                f"(known: {', '.join(LORA_MODULE_KEYS)})"
            )
    else:
        name, _, path = entry.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise ValueError(
            f'--lora-modules: {entry!r} is neither NAME=PATH nor {{"name": NAME, "path": PATH}}'
        )
    return name, path


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's --kv-events-config (its KVEventsConfig's keys and defaults): where and how the
    prefix cache's KV events are published (engine/kv_events.py, engine/kv_publisher.py)."""

    enable_kv_cache_events: bool = False
    publisher: str = ""  # zmq | null; unset: zmq when events are enabled (vLLM's rule)
    endpoint: str = "tcp://*:5557"  # the PUB socket: bound if it has *, ::, ipc:// or inproc://
    replay_endpoint: str | None = None  # a ROUTER socket answering "batches since N"
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher's thread; more: dropped
    topic: str = ""  # llm-d: kv@<pod-ip>:<port>@<model>

    @property
    def publishing(self) -> bool:
        """Events are on and go somewhere (publisher zmq)."""
        return self.enable_kv_cache_events and self.publisher in ("", "zmq")


def kv_events_config(text: str) -> KVEventsConfig | None:
    """--kv-events-config's JSON (None where empty); ValueError naming what is wrong."""
    spec = json_object(text, "--kv-events-config")
    if spec is None:
        return None
    kinds = {f.name: type(f.default) for f in fields(KVEventsConfig)}
    unknown = sorted(set(spec) - set(kinds))
    if unknown:
        raise ValueError(
            f"--kv-events-config: unknown key(s) {', '.join(unknown)} (known: {', '.join(kinds)})"
        )
    for key, value in spec.items():
        kind = str if key == "replay_endpoint" else kinds[key]
        ok = isinstance(value, kind) and (kind is not int or not isinstance(value, bool))
        if not ok and not (key == "replay_endpoint" and value is None):
            raise ValueError(
                f"--kv-events-config: {key} must be of type {kind.__name__}, not {value!r}"
            )
    config = KVEventsConfig(**spec)
    if config.publisher not in ("", "zmq", "null"):
        raise ValueError(
            f"--kv-events-config: publisher must be zmq or null, not {config.publisher!r}"
        )
    if min(config.buffer_steps, config.hwm, config.max_queue_size) < 1:
        raise ValueError("--kv-events-config: buffer_steps, hwm and max_queue_size must be >= 1")
    if config.publishing and not config.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(
            f"--kv-events-config: endpoint must be a tcp://, ipc:// or inproc:// "
            f"address, not {config.endpoint!r}"
        )
    return config


# --kv-transfer-config keys this server honours (none yet: its KV cache stays in RAM)
KV_TRANSFER_HONOURED: frozenset[str] = frozenset()


def kv_transfer_config(text: str) -> dict[str, Any] | None:
    """vLLM's --kv-transfer-config JSON (its KVTransferConfig; KServe's `spec.kvCacheOffloading`
    injects `{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {...}}`): None where empty, ValueError where it is not a JSON
    object. Its keys are not checked against vLLM's: none is served (kv_transfer_notes)."""
    return json_object(text, "--kv-transfer-config")


def json_object(text: str, flag: str) -> dict[str, Any] | None:
    """A flag's JSON object (None where the text is empty); ValueError naming the flag."""
    if not text.strip():
        return None
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag} is not JSON ({exc}): {text!r}") from exc
    if not isinstance(spec, dict):
        raise ValueError(f"{flag} must be a JSON object, not {text!r}")
    return spec


def kv_transfer_notes(spec: dict[str, Any]) -> list[str]:
    """What a start logs of --kv-transfer-config: the connector not served, the keys honoured
    and those not (each line plain: a deployment asked for it and does not get it)."""
    connector = spec.get("kv_connector") or "no kv_connector"
    honoured = sorted(set(spec) & KV_TRANSFER_HONOURED)
    ignored = sorted(set(spec) - KV_TRANSFER_HONOURED)
    return [
        f"kv-transfer-config: {connector} not served, KV stays in RAM",
        f"kv-transfer-config: keys honoured: {', '.join(honoured) or 'none'}; not honoured: "
        f"{', '.join(ignored) or 'none'}",
    ]
