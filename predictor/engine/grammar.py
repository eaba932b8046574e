"""Grammar-constrained decoding with xgrammar: compiling a request's grammar, one matcher per row.

`Grammars` compiles (off the step loop: `AsyncEngine.generate_all` calls it in its worker
thread) and caches compiled grammars by their text in a bounded LRU. A `Matcher` follows one
row: the sampler asks it for the allowed-token bitmask (`fill`) in the batched sampling pass,
the step loop feeds it each accepted token (`accept`) and ends the row once it is `finished`.
Rows without a grammar never meet this module.

A JSON schema keyword outside `SCHEMA_KEYWORDS`, one xgrammar would drop where it stands
(`check_schema`), a regex or EBNF grammar xgrammar cannot compile: `InvalidRequest` naming the
request's key, never unconstrained text.

xgrammar 0.2.9 writes a string with `minLength`/`maxLength` as a bounded repeat of `[^"\\\r\n]`:
raw control characters pass (JSON forbids them unescaped, RFC 8259 section 7, so the answer
would not parse) and no escape can be written (mlc-ai/xgrammar#800, open). `_mend_strings`
rewrites each such rule to one JSON character: an unescaped one or an escape.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterator
from typing import Any

import xgrammar as xgr

from predictor.engine import tool_calls
from predictor.errors import InvalidRequest
from predictor.types import Grammar

# JSON schema keywords xgrammar 0.2.9 enforces (the rest are refused, not ignored)
SCHEMA_KEYWORDS = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
        "pattern", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
        "exclusiveMaximum", "title", "description", "default", "examples", "$schema", "$id",
        "$comment",
    }
)  # fmt: skip
_DATA = frozenset({"enum", "const", "default", "examples"})  # values, not schemas
_NAMED = frozenset({"properties", "$defs", "definitions"})  # name -> schema maps
# A schema with one of these is that branch alone: xgrammar drops any constraint beside it.
_BRANCHES = ("$ref", "const", "enum", "anyOf")
# Constraints xgrammar enforces only on a schema with a `type`, or whose keywords make it an
# object or an array (`_SHAPES`); on any other it writes any JSON value and drops them.
_SCALAR = frozenset(
    {
        "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
        "exclusiveMaximum", "minItems", "maxItems",
    }
)  # fmt: skip
_SHAPES = frozenset({"properties", "additionalProperties", "items", "prefixItems"})
_CONSTRAINTS = _SCALAR | _SHAPES | {"required"}
MAX_GRAMMAR_CHARS = 64 * 1024


def _subschemas(schema: Any, path: str) -> Iterator[tuple[dict[str, Any], str]]:
    """(schema, where) for a JSON schema and every schema inside it."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from _subschemas(item, f"{path}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    yield schema, path
    for key, value in schema.items():
        if key in _DATA:
            continue
        if key in _NAMED and isinstance(value, dict):
            for name, sub in value.items():
                yield from _subschemas(sub, f"{path}/{key}/{name}")
        elif isinstance(value, dict | list):
            yield from _subschemas(value, f"{path}/{key}")


def _dropped(schema: dict[str, Any]) -> str | None:
    """Why xgrammar would not enforce one of this schema's own keywords, if it would not."""
    keys = set(schema)
    branches = [k for k in _BRANCHES if k in keys]
    beside = sorted(_CONSTRAINTS & keys)
    if branches and (len(branches) > 1 or beside):
        other = branches[1] if len(branches) > 1 else beside[0]
        return f"'{other}' beside '{branches[0]}' is not enforced (put it inside the branch)"
    if "pattern" in keys and {"minLength", "maxLength"} & keys:
        return "'pattern' with 'minLength'/'maxLength' is not enforced (fold the length into it)"
    required, properties = schema.get("required"), schema.get("properties")
    listed = properties if isinstance(properties, dict) else {}
    unlisted = [n for n in required if n not in listed] if isinstance(required, list) else []
    if unlisted:
        return f"required property '{unlisted[0]}' is not in 'properties', so is not enforced"
    untyped = sorted(_SCALAR & keys)
    if "type" not in keys and not branches and untyped and not _SHAPES & keys:
        return f"'{untyped[0]}' needs a 'type' beside it to be enforced"
    return None


def check_schema(schema: Any, param: str) -> None:
    """Refuse a JSON schema with a keyword the library would not enforce."""
    if not isinstance(schema, dict | bool):
        raise InvalidRequest(f"'{param}': a JSON schema must be an object", param=param)
    for sub, where in _subschemas(schema, "#"):
        for key in sub:
            if key not in SCHEMA_KEYWORDS:
                raise InvalidRequest(
                    f"'{param}': JSON schema keyword '{key}' (at {where}) is not supported by "
                    "this server's constrained decoding",
                    param=param,
                )
        why = _dropped(sub)
        if why:
            raise InvalidRequest(f"'{param}': at {where}, {why}", param=param)


# A length-bounded string's character as xgrammar 0.2.9 prints it, and what it should be.
_BOUNDED_CHARACTER = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_CHARACTER = r'(([^\0-\x1f\"\\]) | ("\\" json_character_escape))'
_JSON_ESCAPE = (
    r'json_character_escape ::= ([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] '
    r"[A-Fa-f0-9])"
)


def _mend_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """The grammar with every length-bounded string character a JSON character."""
    text = str(grammar)
    mended, count = _BOUNDED_CHARACTER.subn(lambda m: f"{m[1]} ::= {_JSON_CHARACTER}", text)
    if not count:
        return grammar
    return xgr.Grammar.from_ebnf(f"{mended}\n{_JSON_ESCAPE}\n")


def choice_ebnf(choices: list[str]) -> str:
    """One of the given strings, exactly."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class Grammars:
    """Compiles grammars for one tokenizer; compiled grammars cached by their text (LRU)."""

    def __init__(
        self,
        tokenizer: Any,
        stop_ids: Collection[int],
        vocab_size: int | None = None,
        cache_size: int = 128,
    ) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self.vocab_size = self.info.vocab_size
        self.stop_ids = tuple(sorted(stop_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses), for tests and metrics

    def compile(self, grammar: Grammar) -> Any:
        """The compiled grammar (xgr.CompiledGrammar); InvalidRequest naming grammar.param."""
        key = (grammar.kind, grammar.text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(grammar)
        with self._lock:
            self.compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, grammar: Grammar) -> Any:
        param = grammar.param
        if len(grammar.text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(
                f"'{param}' is {len(grammar.text)} characters; at most {MAX_GRAMMAR_CHARS}",
                param=param,
            )
        try:
            if grammar.kind == "json_object":
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False
                )
            if grammar.kind == "json_schema":
                check_schema(json.loads(grammar.text), param)
                schema = xgr.Grammar.from_json_schema(
                    grammar.text, any_whitespace=False, strict_mode=True
                )
                return self._compiler.compile_grammar(_mend_strings(schema))
            if grammar.kind == "regex":
                return self._compiler.compile_regex(grammar.text)
            if grammar.kind == "choice":
                return self._compiler.compile_grammar(choice_ebnf(json.loads(grammar.text)))
            if grammar.kind == "ebnf":
                return self._compiler.compile_grammar(grammar.text)
            if grammar.kind == "structural_tag":  # tool calls (engine/tool_calls.py)
                for schema in tool_calls.schemas(json.loads(grammar.text)):
                    check_schema(schema, param)
                tags = xgr.Grammar.from_structural_tag(grammar.text)
                return self._compiler.compile_grammar(_mend_strings(tags))
        except InvalidRequest:
            raise
        except Exception as exc:  # xgrammar's parse errors say what is wrong: pass it on
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidRequest(
                f"'{param}' cannot be enforced: {message[:300]}", param=param
            ) from exc
        raise InvalidRequest(f"'{param}': unknown grammar kind '{grammar.kind}'", param=param)

    def matcher(self, compiled: Any) -> Matcher:
        return Matcher(compiled, self)


class Matcher:
    """One row's position in its grammar."""

    __slots__ = ("_matcher", "_grammars", "failed")

    def __init__(self, compiled: Any, grammars: Grammars) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._grammars = grammars
        self.failed = False  # a token the grammar did not allow was accepted (a bug)

    @property
    def vocab_size(self) -> int:
        return self._grammars.vocab_size

    def fill(self, bitmask: Any, index: int) -> None:
        """Write the allowed next tokens into row `index` of an xgrammar bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, index)

    def accept(self, token: int) -> bool:
        ok = bool(self._matcher.accept_token(token))
        self.failed = self.failed or not ok
        return ok

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more than ending: the row is done."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        for stop in self._grammars.stop_ids:
            if stop < self.vocab_size:
                clear = ~(1 << (stop % 32)) & 0xFFFFFFFF  # as an int32's two's complement
                bitmask[0, stop // 32] &= clear - (1 << 32) if clear >= 1 << 31 else clear
        return not bool(bitmask.any())
