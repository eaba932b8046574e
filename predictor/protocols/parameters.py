"""Every sampling parameter and request option, in one table, and the one validator over it.

A row says a key's type, range, default, aliases and which protocols take it; the V2 / OIP /
Triton decoders and OpenAI's bodies all read their keys through `read`, and the OpenAPI
document (`protocols/schemas.py`) is generated from the same rows. A new parameter is one row
here (plus its field in `types.SamplingParams` and, for a sampler term, `engine/sampling.py`).

Protocols: `v2` (V2 infer / infer_stream / ModelStreamInfer `parameters`), `generate` (the OIP
generate body: `parameters` and Triton's top-level keys), `triton` (the vLLM backend's
`sampling_parameters` JSON and one-element input tensors named like parameters, as the
TensorRT-LLM backend takes them), `openai` (completions and chat bodies) and `anthropic`
(Messages bodies: Anthropic's sampling fields only, `stop_sequences` the name of `stop`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from predictor.errors import InvalidRequest
from predictor.protocols import structured
from predictor.protocols.limits import json_text
from predictor.types import SamplingParams

Kind = Literal["integer", "number", "boolean", "stop", "string", "grammar", "bias"]
ProtocolName = Literal["v2", "generate", "triton", "openai", "anthropic"]
ALL: frozenset[str] = frozenset({"v2", "generate", "triton", "openai"})
OIP: frozenset[str] = frozenset({"v2", "generate", "triton"})
# Anthropic's Messages take only its own sampling fields: the rows below that list it
ANTHROPIC: frozenset[str] = frozenset({"anthropic"})
WITH_ANTHROPIC: frozenset[str] = ALL | ANTHROPIC

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
SEED_LIMIT = 2**63  # seeds are non-negative 64-bit integers
MAX_SALT_LENGTH = 256
MAX_PROMPT_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True)
class Parameter:
    name: str
    kind: Kind
    default: Any  # None: none (seed, timeout) or, for max_tokens, the server's default
    help: str
    low: float | None = None  # a string's length: low and high bound it
    high: float | None = None
    low_open: bool = False  # the range excludes `low`
    high_open: bool = False  # the range excludes `high`
    aliases: tuple[str, ...] = ()  # other names of the key (TensorRT-LLM's), in OIP protocols
    protocols: frozenset[str] = ALL
    tensor: str | None = None  # the V2 datatype of its Triton input tensor, if it has one
    # per protocol, fields that differ there (OpenAI's temperature: default 1, at most 2)
    overrides: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    sampling: bool = True  # a SamplingParams field (else a request option: chat, timeout)
    field: str | None = None  # the SamplingParams field it fills, when not its name

    def within(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or not (
            value > self.high or (self.high_open and value == self.high)
        )

    def range_text(self) -> str:
        low = "-inf" if self.low is None else _number_text(self.low)
        high = "inf" if self.high is None else _number_text(self.high)
        return f"{'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else str(value)


TABLE: tuple[Parameter, ...] = (
    Parameter("max_tokens", "integer", None, "most tokens to generate (default: the server's "
              "--default-max-tokens; capped by --max-tokens-limit; OpenAI completions: 0 with "
              "echo returns the prompt only; Anthropic: required)", low=1, tensor="INT32",
              overrides=(("openai", (("low", 0),)),), protocols=WITH_ANTHROPIC),
    Parameter("temperature", "number", 0.0, "0 is greedy", low=0, high=100, tensor="FP32",
              overrides=(("openai", (("default", 1.0), ("high", 2))),
                         ("anthropic", (("default", 1.0), ("high", 1)))),
              protocols=WITH_ANTHROPIC),
    Parameter("top_p", "number", 1.0, "nucleus sampling mass", low=0, high=1, low_open=True,
              tensor="FP32", protocols=WITH_ANTHROPIC),
    Parameter("top_k", "integer", 0, "sample from the k most likely tokens (0: off)", low=0,
              tensor="INT32", overrides=(("openai", (("low", -1),)),),  # vLLM: -1 is off too
              protocols=WITH_ANTHROPIC),
    Parameter("seed", "integer", None, "seed of the request's own generator", low=0,
              high=SEED_LIMIT, high_open=True, aliases=("random_seed",), tensor="UINT64"),
    Parameter("stop", "stop", (), f"a string or up to {MAX_STOP_STRINGS} strings that end the "
              "text (over gRPC: a string holding a JSON list; Anthropic: stop_sequences)",
              aliases=("stop_words",), tensor="BYTES", protocols=WITH_ANTHROPIC,
              overrides=(("anthropic", (("name", "stop_sequences"), ("field", "stop"))),)),
    Parameter("ignore_eos", "boolean", False, "keep generating past end-of-sequence tokens",
              tensor="BOOL"),
    Parameter("min_tokens", "integer", 0, "tokens before end-of-sequence or a stop string may "
              "end the text", low=0, aliases=("min_length",), tensor="INT32"),
    Parameter("presence_penalty", "number", 0.0, "subtracted once from each generated token's "
              "logit (OpenAI)", low=-2, high=2, tensor="FP32"),
    Parameter("frequency_penalty", "number", 0.0, "subtracted per occurrence in the generated "
              "text (OpenAI)", low=-2, high=2, tensor="FP32"),
    Parameter("repetition_penalty", "number", 1.0, "divides positive and multiplies negative "
              "logits of prompt and generated tokens (HF, vLLM, TGI; 1: off, > 1 penalises)",
              low=0, low_open=True, tensor="FP32"),
    Parameter("logit_bias", "bias", (), "{token id: bias in [-100, 100]} added to the logits "
              f"(OpenAI's; at most {MAX_LOGIT_BIAS} entries; over gRPC: a JSON string)",
              low=-100, high=100),
    Parameter("prompt_logprobs", "integer", None, "vLLM's: each prompt token's logprob, rank "
              f"and the k most likely tokens at its position (0 to {MAX_PROMPT_LOGPROBS}; not "
              "with stream)", low=0, high=MAX_PROMPT_LOGPROBS, protocols=frozenset({"openai"})),
    Parameter("structured_outputs", "grammar", None, "vLLM's constrained decoding: an object "
              "with one of json (a JSON schema), regex, choice (a list of strings), grammar "
              "(EBNF) or json_object: true (over gRPC: a string holding that object)",
              field="grammar"),
    Parameter("response_format", "grammar", None, "OpenAI's: {type: text | json_object | "
              "json_schema, json_schema: {name, schema, strict}}", protocols=frozenset({"openai"}),
              field="grammar"),
    Parameter("speculative", "boolean", True, "false: this request never drafts tokens "
              "(speculative decoding; the server drafts only where it pays)", tensor="BOOL"),
    Parameter("priority", "integer", 0, "vLLM's: requests with a lower value are admitted "
              "first and preempted last (then first come, first served)", low=-(2**31),
              high=2**31 - 1, tensor="INT32"),
    Parameter("chat", "boolean", False, "apply the model's chat template to the prompt",
              protocols=OIP, sampling=False),
    Parameter("timeout", "number", None, "seconds the request may run", low=0, low_open=True,
              protocols=OIP, sampling=False),
    Parameter("cache_salt", "string", None, "requests share cached prompt blocks only with the "
              f"same salt (vLLM's; 1 to {MAX_SALT_LENGTH} characters)", low=1,
              high=MAX_SALT_LENGTH, sampling=False),
)  # fmt: skip

_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
assert all((p.field or p.name) in _SAMPLING_FIELDS for p in TABLE if p.sampling), "no field"


def rows(protocol: str) -> tuple[Parameter, ...]:
    """The rows a protocol takes, with that protocol's overrides applied."""
    out = []
    for row in TABLE:
        if protocol not in row.protocols:
            continue
        changes = dict(next((c for p, c in row.overrides if p == protocol), ()))
        out.append(replace(row, **changes) if changes else row)
    return tuple(out)


def _keys(row: Parameter, protocol: str) -> tuple[str, ...]:
    return (row.name, *row.aliases) if protocol in OIP else (row.name,)


def names(protocol: str) -> tuple[str, ...]:
    """The keys a protocol takes (aliases included)."""
    return tuple(n for row in rows(protocol) for n in _keys(row, protocol))


def _by_name(protocol: str) -> dict[str, Parameter]:
    return {n: row for row in rows(protocol) for n in _keys(row, protocol)}


@dataclass(frozen=True)
class Values:
    """A request's parameters, checked: its sampling and its options."""

    sampling: SamplingParams
    chat: bool = False
    timeout: float | None = None
    cache_salt: str | None = None


def read(
    params: Mapping[str, Any],
    protocol: str,
    default_max_tokens: int,
    coerce: bool = False,
    max_depth: int = 32,
) -> Values:
    """Check every key of the table in `params` and build the request's values.

    Keys the table does not have are left alone (the caller refuses or ignores them). A key and
    its alias with different values are ambiguous. `coerce`: strings become numbers or booleans
    ("0.1", "true") as the Triton vLLM backend converts them. `max_depth` bounds a stop list given
    as a JSON string.
    """
    table = _by_name(protocol)
    given: dict[str, tuple[str, Any]] = {}
    for key, value in params.items():
        row = table.get(key)
        if row is None or value is None:  # absent, or JSON null: the default
            continue
        if key == "stop_words" and value in ("", [], [""]):  # TensorRT-LLM's "none"
            continue
        value = _coerced(row, value) if coerce else value
        if row.name in given and given[row.name][1] != value:
            raise InvalidRequest(
                f"'{given[row.name][0]}' and '{key}' are both given with different values: "
                "the request is ambiguous",
                param=key,
            )
        given.setdefault(row.name, (key, value))
    out: dict[str, Any] = {}
    for row in rows(protocol):
        if row.name in given:
            key, value = given[row.name]
            out[row.name] = _check(row, key, value, max_depth)
        else:
            out[row.name] = row.default
    if out.get("max_tokens") is None:
        out["max_tokens"] = default_max_tokens
    if not 0 <= out.get("min_tokens", 0) <= out["max_tokens"]:
        raise InvalidRequest(
            f"parameter 'min_tokens' must be between 0 and max_tokens ({out['max_tokens']}), "
            f"got {out['min_tokens']}",
            param="min_tokens",
        )
    out["top_k"] = max(out.get("top_k", 0), 0)  # -1 (vLLM, OpenAI) is off, as 0 is
    kwargs: dict[str, Any] = {}
    for row in rows(protocol):
        name = row.field or row.name
        if not row.sampling or out[row.name] is None and name in kwargs:
            continue
        if kwargs.get(name) is not None and out[row.name] is not None:
            raise InvalidRequest(
                f"'{row.name}' and another key both set '{name}': the request is ambiguous",
                param=row.name,
            )
        kwargs[name] = out[row.name]
    sampling = SamplingParams(**kwargs)
    return Values(sampling, bool(out.get("chat", False)), out.get("timeout"), out.get("cache_salt"))


def _check(row: Parameter, key: str, value: Any, max_depth: int) -> Any:
    if row.kind == "stop":
        return _stop(key, value, max_depth)
    if row.kind == "string":
        if not isinstance(value, str) or not row.within(len(value)):
            raise InvalidRequest(
                f"parameter '{key}' must be a string of {_number_text(row.low or 0)} to "
                f"{_number_text(row.high or 0)} characters",
                param=key,
            )
        return value
    if row.kind == "grammar":
        return structured.grammar(key, value, max_depth)
    if row.kind == "bias":
        return _bias(row, key, value, max_depth)
    if row.kind == "boolean":
        if not isinstance(value, bool):
            raise InvalidRequest(f"parameter '{key}' must be a boolean, got {value!r}", param=key)
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "an integer" if row.kind == "integer" else "a number"
        raise InvalidRequest(f"parameter '{key}' must be {kind}, got {value!r}", param=key)
    if not math.isfinite(value):
        raise InvalidRequest(f"parameter '{key}' must be finite", param=key)
    if row.kind == "integer":
        if int(value) != value:
            raise InvalidRequest(f"parameter '{key}' must be an integer, got {value!r}", param=key)
        value = int(value)
    else:
        value = float(value)
    if not row.within(value):
        raise InvalidRequest(
            f"parameter '{key}' must be in {row.range_text()}, got {value!r}", param=key
        )
    return value


def _stop(key: str, value: Any, max_depth: int) -> tuple[str, ...]:
    if isinstance(value, str):
        # gRPC maps carry no lists: a JSON array in a string parameter is accepted too
        if value.startswith("["):
            value = json_text(value, max_depth, key, "a valid JSON array")
        else:
            value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequest(f"parameter '{key}' must be a string or a list of strings", param=key)
    if key == "stop_words":  # TensorRT-LLM sends "" for none
        value = [s for s in value if s != ""]
    if len(value) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"parameter '{key}' has {len(value)} strings; at most {MAX_STOP_STRINGS}", param=key
        )
    if any(len(s) > MAX_STOP_LENGTH for s in value):
        raise InvalidRequest(
            f"each stop string must be at most {MAX_STOP_LENGTH} characters", param=key
        )
    if any(s == "" for s in value):
        raise InvalidRequest("stop strings must not be empty", param=key)
    return tuple(value)


def _bias(row: Parameter, key: str, value: Any, max_depth: int) -> tuple[tuple[int, float], ...]:
    if isinstance(value, str):
        value = json_text(value, max_depth, key)
    if not isinstance(value, dict):
        raise InvalidRequest(f"parameter '{key}' must be an object of token id: bias", param=key)
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"parameter '{key}' has {len(value)} entries; at most {MAX_LOGIT_BIAS}", param=key
        )
    out = []
    for token, bias in value.items():
        if not (isinstance(token, str) and re.fullmatch(r"\d{1,9}", token)):
            raise InvalidRequest(f"parameter '{key}': '{token}' is not a token id", param=key)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise InvalidRequest(f"parameter '{key}': bias of {token} must be a number", param=key)
        if not row.within(bias):
            raise InvalidRequest(
                f"parameter '{key}': bias of {token} must be in {row.range_text()}", param=key
            )
        out.append((int(token), float(bias)))
    return tuple(sorted(out))


def _coerced(row: Parameter, value: Any) -> Any:
    """A string value for a numeric or boolean key, as the vLLM backend converts it ("0.1")."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if row.kind == "integer" and re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if row.kind == "number":
        try:
            return float(text)
        except ValueError:
            return value
    if row.kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return value


def coerced(key: str, value: Any, protocol: str) -> Any:
    """`value` as `read(coerce=True)` would take it (for comparing one key given twice)."""
    row = _by_name(protocol).get(key)
    return value if row is None else _coerced(row, value)


def canonical(key: str, protocol: str) -> str:
    """The row name a key (or alias) stands for; unknown keys stand for themselves."""
    row = _by_name(protocol).get(key)
    return key if row is None else row.name


def tensor_rows() -> dict[str, Parameter]:
    """Triton input tensor name -> its row: every name and alias of a row with a tensor."""
    return {n: row for row in rows("triton") if row.tensor for n in (row.name, *row.aliases)}
