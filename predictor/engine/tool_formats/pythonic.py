"""Python-style tool calls (parser `pythonic`, vLLM's name; Gemma's format): the calls as a
Python list of keyword calls, `[get_weather(city="Paris"), f(x=1)]`, what Gemma's
function-calling guide asks for (and Llama 3.2/4's pythonic prompts). Gemma 3's
```` ```tool_code ```` block (a call a line, or a list) is read too. Gemma's templates render no
tools: they go in the system turn with these instructions, past calls as the text the model
writes, tool answers as ```` ```tool_output ```` blocks in user turns (`plain.py`).

Reading a call back never evaluates it: the name and each `key=` are matched as text (a key
the schema names need not be a Python identifier: `from=` is read as written), each value is
parsed with `ast` and taken only when it is a literal (str, number, bool, None, list, tuple,
dict with str keys; JSON's `true`/`false`/`null` too, which the grammar writes inside nested
values). Positional arguments, names, calls, operators: not a call, the text stays content.

The grammar (xgrammar's structural tag) writes the list: each call `NAME(` then the schema's
properties in its order, as `key=VALUE` (a required one always, an optional one or not, `, `
between them), each value a JSON value of its property's schema (Python's `True`/`False`/`None`
where the property is a boolean or null), then `)`. A schema without `properties` takes any
keyword arguments.
"""

from __future__ import annotations

import ast
import json
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from predictor.engine.tool_formats.base import MAX_WHITESPACE, BlockParser, Choice, Delta, held
from predictor.engine.tool_formats.plain import has_tool_turns, instructions, plain

CODE_BEGIN = "```tool_code"
CODE_END = "```"
SEPARATOR = ", "

_NAME = r"[^\W\d][\w.-]*"  # a tool's name: letters (any script), digits, _ . -
_LIST_OPEN = re.compile(rf"\[\s*{_NAME}\s*\(")  # a list of calls begins
_LIST_HELD = re.compile(rf"\[\s*(?:{_NAME}\s*)?$")  # text that may become one
_CALL_OPEN = re.compile(rf"({_NAME})\s*\(")
_CALL_PREFIX = re.compile(rf"{_NAME}\s*")
_KEY = re.compile(r"\s*([^\W\d][\w-]*)\s*=(?!=)")
_KEY_PREFIX = re.compile(r"\s*(?:[^\W\d][\w-]*\s*)?")
_JSON_NAMES = {"true": True, "false": False, "null": None}
_IDENTIFIER = "[A-Za-z_][A-Za-z0-9_]*"


# -- values: Python literals and back ----------------------------------------------------------


class NotLiteral(ValueError):
    """Python text that parses but is no literal value."""


def literal(node: ast.AST) -> Any:
    """The JSON value of a literal's syntax tree; NotLiteral for anything else."""
    if isinstance(node, ast.Constant):
        constant = node.value
        if constant is None or isinstance(constant, (str, bool, int)):
            return constant
        if isinstance(constant, float) and math.isfinite(constant):
            return constant
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        number = literal(node.operand)
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [literal(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            name = None if key is None else literal(key)
            if not isinstance(name, str):
                raise NotLiteral("a dict key that is not a string")
            out[name] = literal(value)
        return out
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise NotLiteral(type(node).__name__)


def _parse_value(text: str) -> Any:
    """`text` as one literal value; SyntaxError where it does not parse (yet), NotLiteral where
    it parses as something else."""
    with warnings.catch_warnings():  # "\\/" and other escapes Python does not know
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes, deep nesting
            raise NotLiteral(str(exc)) from None
    return literal(tree.body)


def python_value(value: Any) -> str:
    """A JSON value as Python literal text."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_value(v) for v in value) + "]"
    if isinstance(value, dict):
        pairs = value.items()
        items = (f"{json.dumps(k, ensure_ascii=False)}: {python_value(v)}" for k, v in pairs)
        return "{" + SEPARATOR.join(items) + "}"
    return json.dumps(value, ensure_ascii=False)


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (arguments a dict or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return f"{name}({arguments})"  # shown as given
    if not isinstance(arguments, dict):
        return f"{name}({python_value(arguments)})"
    return f"{name}(" + SEPARATOR.join(f"{k}={python_value(v)}" for k, v in arguments.items()) + ")"


def calls_text(calls: Sequence[tuple[str, Any]]) -> str:
    return "[" + SEPARATOR.join(call_text(n, a) for n, a in calls) + "]"


# -- reading calls back ------------------------------------------------------------------------

_INCOMPLETE = object()  # more text may make it a call


def read_arguments(text: str) -> tuple[dict[str, Any], int] | None | object:
    """`text` starts after a call's `(`: its keyword arguments and the length through its `)`;
    None where it is no call whatever follows; `_INCOMPLETE` where more text may decide."""
    arguments: dict[str, Any] = {}
    at = 0
    while True:
        close = re.match(r"\s*\)", text[at:])
        if close:
            return arguments, at + close.end()
        key = _KEY.match(text, at)
        if key is None:
            return _INCOMPLETE if _KEY_PREFIX.fullmatch(text, at) else None
        name, start = key.group(1), key.end()
        if name in arguments:
            return None
        # the value: the shortest text up to a `,` or `)` that parses
        for end in (i for i in range(start, len(text)) if text[i] in ",)"):
            try:
                arguments[name] = _parse_value(text[start:end])
            except SyntaxError:
                continue
            except NotLiteral:
                return None
            at = end + 1 if text[end] == "," else end
            break
        else:
            return _INCOMPLETE


class StreamParser(BlockParser):
    """Streamed text -> deltas: content until a list of calls (`[NAME(`) or a tool_code block
    begins, then each call, name and arguments at once, as soon as its `)` closes it. Text that
    may be the start of either is held back; a block in which no call is read is content, its
    opening included, as the model wrote it."""

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None  # "list" | "code" while in calls
        self._block = ""  # the current block's text so far, its opening included
        self._block_calls = 0
        self._scanned = 0  # the buffer's characters already tried for the current call
        self.calls = 0

    def _in_block(self) -> bool:
        return self._mode is not None

    def _text(self) -> list[Delta]:
        code = self._buffer.find(CODE_BEGIN)
        listed = _LIST_OPEN.search(self._buffer)
        found = [(code, "code", len(CODE_BEGIN))] if code >= 0 else []
        found += [(listed.start(), "list", 1)] if listed else []
        if found:
            at, mode, marker = min(found)
            before = self._buffer[:at]
            ready = before.strip() if self._block_calls else before.rstrip()
            # the block's text, the whitespace before it included, is content if no call is in it
            self._block = ("" if self._block_calls else before[len(ready) :]) + self._buffer[
                at : at + marker
            ]
            self._buffer = self._buffer[at + marker :]
            self._mode, self._block_calls, self._scanned = mode, 0, 0
            return [Delta("content", ready)] if ready else []
        if self._block_calls:  # whitespace after calls is not content
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return []
            self._block_calls = 0
        tail = _LIST_HELD.search(self._buffer)
        keep = max(held(self._buffer, CODE_BEGIN), len(self._buffer) - tail.start() if tail else 0)
        # whitespace before a possible call waits: it goes if a call follows
        ready = self._buffer[: len(self._buffer) - keep].rstrip()
        self._buffer = self._buffer[len(ready) :]
        return [Delta("content", ready)] if ready else []

    def _close(self, text: str) -> list[Delta]:
        """The calls end; `text` (what is not a call) goes back to text, with the block's own
        text before it when the block held no call."""
        self._mode = None
        self._buffer = text + self._buffer
        if self._block_calls == 0:
            block, self._block = self._block, ""
            return [Delta("content", block)] if block else []
        return []

    def _end(self, size: int) -> list[Delta]:
        self._buffer, self._mode = self._buffer[size:], None
        return []

    def _calls(self, final: bool) -> list[Delta]:
        skip = " \t\r\n," if self._mode == "list" else " \t\r\n,;[]"
        skipped = len(self._buffer) - len(self._buffer.lstrip(skip))
        if skipped:
            self._block += self._buffer[:skipped]
            self._buffer, self._scanned = self._buffer[skipped:], 0
        if not self._buffer:
            return self._close("") if final else []
        if self._mode == "list" and self._buffer.startswith("]"):
            return self._end(1)
        if self._mode == "code":
            if self._buffer.startswith(CODE_END):
                return self._end(len(CODE_END))
            if CODE_END.startswith(self._buffer):  # cut off in the end: the calls are whole
                return self._end(len(self._buffer)) if final else []
        opened = _CALL_OPEN.match(self._buffer)
        if opened is None:
            if not final and _CALL_PREFIX.fullmatch(self._buffer):
                return []
            rest, self._buffer = self._buffer, ""
            return self._close(rest)
        if not final and ")" not in self._buffer[max(self._scanned, opened.end()) :]:
            self._scanned = len(self._buffer)
            return []
        read = read_arguments(self._buffer[opened.end() :])
        if not isinstance(read, tuple):
            if read is _INCOMPLETE and not final:
                self._scanned = len(self._buffer)
                return []
            rest, self._buffer = self._buffer, ""
            return self._close(rest)
        arguments, size = read
        size += opened.end()
        self._block += self._buffer[:size]
        self._buffer, self._scanned = self._buffer[size:], 0
        index = self.calls
        self.calls += 1
        self._block_calls += 1
        text = json.dumps(arguments, ensure_ascii=False)
        return [Delta("call", opened.group(1), index), Delta("arguments", text, index)]


# -- the grammar -------------------------------------------------------------------------------


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": list(elements)}


def _value(schema: Any, definitions: Mapping[str, Any]) -> dict[str, Any]:
    """A property's value: Python's spellings for a boolean or null, else a JSON value."""
    if isinstance(schema, dict) and not {"enum", "const"} & set(schema):
        if schema.get("type") == "boolean":
            return {"type": "or", "elements": [_const("True"), _const("False")]}
        if schema.get("type") == "null":
            return _const("None")
    if isinstance(schema, dict) and definitions:  # a `$ref` into the parameters' own
        schema = {**definitions, **schema}
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def _arguments(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments `parameters` (a JSON schema of an object) allows, in its order."""
    definitions = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    if "properties" not in parameters:  # any keyword arguments, of the values allowed
        extra = parameters.get("additionalProperties", True)
        if extra is False:
            return _const("")
        value = _value(extra if isinstance(extra, dict) else {}, definitions)
        pair = _sequence({"type": "regex", "pattern": _IDENTIFIER}, _const("="), value)
        more = {"type": "star", "content": _sequence(_const(SEPARATOR), pair)}
        return {"type": "optional", "content": _sequence(pair, more)}
    required = set(parameters.get("required") or ())
    items = [
        (name in required, _sequence(_const(f"{name}="), _value(schema, definitions)))
        for name, schema in (parameters.get("properties") or {}).items()
    ]
    if not items:
        return _const("")
    # which property comes first decides where the separators go: any one up to the first
    # required one (or none at all, where none is required)
    firsts: list[dict[str, Any]] = []
    for first, (needed, item) in enumerate(items):
        rest = [
            _sequence(_const(SEPARATOR), later)
            if must
            else {"type": "optional", "content": _sequence(_const(SEPARATOR), later)}
            for must, later in items[first + 1 :]
        ]
        firsts.append(_sequence(item, *rest))
        if needed:
            break
    else:
        firsts.append(_const(""))
    return firsts[0] if len(firsts) == 1 else {"type": "or", "elements": firsts}


def _tag(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "tag",
        "begin": f"{function['name']}(",
        "content": _arguments(parameters),
        "end": ")",
    }


def structural_tag(functions: Sequence[Mapping[str, Any]], choice: Choice, parallel: bool) -> str:
    """The structural tag (JSON text) for the calls `choice` allows among `functions`."""
    chosen = [f for f in functions if choice in ("auto", "required") or f["name"] == choice]
    tags = [_tag(f) for f in chosen]
    single = not parallel or choice not in ("auto", "required")
    if choice == "auto":  # free text, in which `[NAME(` begins the list of calls
        more: list[dict[str, Any]] = []
        if not single:
            others = {"type": "or", "elements": tags} if len(tags) > 1 else tags[0]
            more = [{"type": "star", "content": _sequence(_const(SEPARATOR), others)}]
        lists = [
            {
                "type": "tag",
                "begin": f"[{t['begin']}",
                "content": _sequence(t["content"], _const(")"), *more),
                "end": "]",
            }
            for t in tags
        ]
        form: dict[str, Any] = {
            "type": "triggered_tags",
            "triggers": [t["begin"] for t in lists],
            "tags": lists,
            "at_least_one": False,
            "stop_after_first": True,
        }
    else:
        calls = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": SEPARATOR,
            "at_least_one": True,
            "stop_after_first": single,
        }
        form = {"type": "tag", "begin": "[", "content": calls, "end": "]"}
    return json.dumps({"type": "structural_tag", "format": form}, ensure_ascii=False)


# -- the format --------------------------------------------------------------------------------


def _answer(content: str) -> str:
    return f"```tool_output\n{content}\n```"


class Pythonic:
    """The format as `ToolFormat` (engine/tool_formats/base.py)."""

    name = "pythonic"
    markers: tuple[str, ...] = ()  # text: ```tool_code fences and brackets

    def render(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template: str | None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if not tools and not has_tool_turns(conversation):
            return [dict(m) for m in conversation], {}
        example = calls_text([("function_name", {"argument": "value"})])
        turns = plain(conversation, tools, template, calls_text, instructions(example), _answer)
        return turns, {}

    def structural_tag(
        self, functions: Sequence[Mapping[str, Any]], choice: Choice, parallel: bool
    ) -> str:
        return structural_tag(functions, choice, parallel)

    def parser(self) -> StreamParser:
        return StreamParser()


PYTHONIC = Pythonic()
