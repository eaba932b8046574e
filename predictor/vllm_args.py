"""`vllm serve`'s spellings of this server's settings: what a deployment written for vLLM passes
(KServe's LLMInferenceService templates its engine command and appends its LoRA flags), read
into the same Settings (config.py builds the parser and calls these)."""

from __future__ import annotations

import argparse
import json
from typing import Any

# Settings fields also set by vLLM's flag of another name
FLAG_ALIASES = {
    "http_port": ("--port",),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument(
        "--enable-lora", action="store_true", help="vLLM's; adapters need no switch here"
    )


class _ServedNames(argparse.Action):
    """vLLM's --served-model-name NAME [NAME ...]: the model's name, then the others (before
    --model-aliases', in Settings.from_sources)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        namespace.model_name = values[0]
        namespace.served_aliases = tuple(values[1:])


def lora_module(entry: str) -> tuple[str, str]:
    """A --lora-modules entry as (name, path): `NAME=PATH`, or vLLM's JSON form."""
    if entry.startswith("{"):
        try:
            spec = json.loads(entry)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: {entry!r} is not JSON ({exc})") from exc
        name, path = (spec.get("name"), spec.get("path")) if isinstance(spec, dict) else (0, 0)
    else:
        name, _, path = entry.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise ValueError(f"--lora-modules: {entry!r} is neither NAME=PATH nor "
                         '{"name": NAME, "path": PATH}')  # fmt: skip
    return name, path
