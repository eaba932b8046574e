"""`vllm serve`'s spellings of this server's settings: what a deployment written for vLLM passes
(KServe's LLMInferenceService templates its engine command and appends its LoRA flags), read
into the same Settings (config.py builds the parser and calls these). A boolean flag is written
as vLLM writes its own (argparse.BooleanOptionalAction): `--flag` alone, `--no-flag`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

# Settings fields also set by vLLM's flag of another name
FLAG_ALIASES = {
    "http_port": ("--port",),
    "prefix_caching": ("--enable-prefix-caching",),  # and --no-enable-prefix-caching
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
    parser: argparse.ArgumentParser,
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
    add_boolean(
        parser, ["--enable-lora"], "enable_lora", False, "vLLM's; adapters need no switch here"
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
