"""Grammar-constrained decoding with xgrammar: compiling a request's grammar, one matcher per row.

`Grammars` compiles on a pool of its own (never the step loop, never the pool that tokenizes;
`AsyncEngine.generate_all` awaits `compile_async`), bounded in time and in compiles at once,
and caches compiled grammars by their text. A `Matcher` follows one row: the sampler asks it
for the allowed-token bitmask (`fill`) in the batched sampling pass, the step loop feeds it each
accepted token (`accept`) and ends the row once it is `finished`. Rows without a grammar never
meet this module.

The compile budget (`--grammar-compile-timeout`) times a grammar's own compile: it starts when
the compile starts on a pool thread, not when the request arrives, so waiting behind other
clients' compiles is never this client's "too complex". A compile that itself runs past it is
the client's 400 (InvalidRequest); a request whose compile has not started within the budget
is told the server is busy (Overloaded: 429 with Retry-After, as a full waiting queue is), and
its queued compile is dropped unless another request waits for the same grammar.

The pool (`compile_pool.py`) has every usable CPU but one (at least one thread): the last is
decoding's. xgrammar's compile cannot be paused or cancelled, so on 2 cores (one compile thread)
four slow regexes would hold a one-property schema for their whole compiles; instead a compile
that has run `quantum` (0.1 s) while another waits is demoted to nice 19 and runs on beside
the pool, whose thread takes the next compile. A cheap schema then starts within a quantum
and compiles at the pool's priority (nice 10) against the demoted ones' (nice 19), with the
step loop (nice 0) above both: it answers about as fast as on an idle server
(tests/serving/test_grammar_busy.py), while the slow ones use what is idle and are cached.
The price: where every core is busy, a demoted compile gets little CPU and may run past its
budget (400) though it would have finished within it on a quiet server; it still finishes and
is cached, so a retry is answered from the cache.

What cannot be enforced or satisfied is `InvalidRequest` naming the request's key, never
unconstrained text nor a fault of the model: a JSON schema `schema_check.py` refuses, a regex or
EBNF grammar xgrammar cannot compile (its message, without its internals), a grammar whose
language `grammar_check.py` finds empty, one that no first token can begin.

xgrammar 0.2.9 writes a string with `minLength`/`maxLength` as a bounded repeat of `[^"\\\r\n]`:
raw control characters pass (JSON forbids them unescaped, RFC 8259 section 7, so the answer
would not parse) and no escape can be written (mlc-ai/xgrammar#800, open). `_mend_strings`
rewrites each such rule to one JSON character: an unescaped one or an escape.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Collection
from concurrent.futures import Future
from functools import partial
from typing import Any

import xgrammar as xgr

from predictor.engine.compile_pool import CompilePool, Job, default_threads
from predictor.engine.grammar_check import empty_rule
from predictor.engine.schema_check import check_schema
from predictor.engine.tool_formats.base import schemas as tool_schemas
from predictor.errors import InvalidRequest, Overloaded
from predictor.types import Grammar

MAX_GRAMMAR_CHARS = 64 * 1024
COMPILE_NICENESS = 10  # of the compile threads (0: as the rest of the server)
# how long a compile holds a pool thread while another waits for one (then it runs on at the
# lowest priority, beside the pool): long past a one-property schema's whole compile
QUANTUM_SECONDS = 0.1


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


def _result(cached: Any) -> Any:
    """A cached compile: the grammar, or the refusal raised again."""
    if isinstance(cached, InvalidRequest):
        raise InvalidRequest(str(cached), param=cached.param)
    return cached


class _Pending:
    """A grammar compiling: its job on the pool, and how many requests wait for it."""

    __slots__ = ("job", "waiters")

    def __init__(self, job: Job[Any]) -> None:
        self.job, self.waiters = job, 0


def _awaitable(future: Future[Any]) -> Awaitable[Any]:
    """A pool future to await on the event loop; cancelling the wait leaves the job alone."""
    return asyncio.shield(asyncio.wrap_future(future))


def _build(grammar: Grammar) -> xgr.Grammar:
    """The request's grammar as xgrammar's (not compiled yet); InvalidRequest for what
    check_schema refuses."""
    kind, text, param = grammar.kind, grammar.text, grammar.param
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "json_schema":
        check_schema(json.loads(text), param)
        schema = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        return _mend_strings(schema)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    if kind == "structural_tag":  # tool calls (engine/tool_formats/)
        for schema in tool_schemas(json.loads(text)):
            check_schema(schema, param)
        return _mend_strings(xgr.Grammar.from_structural_tag(text))
    raise InvalidRequest(f"'{param}': unknown grammar kind '{kind}'", param=param)


_LIBRARY_NOISE = (
    re.compile(r"^\[\d{2}:\d{2}:\d{2}\]\s*"),  # xgrammar's time stamp
    re.compile(r"^\S+\.(cc|cpp|h|hpp|pxi|py):\d+:\s*"),  # its source file and line
)


def library_message(exc: BaseException) -> str:
    """What xgrammar says is wrong, without its time stamp and C++ source location."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    for noise in _LIBRARY_NOISE:
        line = noise.sub("", line)
    return line[:300]


class Grammars:
    """Compiles grammars for one tokenizer, on a small pool of its own, and caches them.

    `compile_async` is the requests' way in: a compile runs on this object's pool (never the
    pool that tokenizes; `threads` of them, 0: every usable CPU but one), at a low CPU priority
    so that decoding and serving keep their cores; at most `max_in_flight` compiles run or wait
    at once (more: Overloaded, a 429). `timeout` is each compile's own budget, from when it
    starts on a thread: past it, InvalidRequest (too complex); a request whose compile has not
    started `timeout` s after it asked is Overloaded (the server is busy: retry). A compile that
    runs `quantum` s while another waits gives its thread up and runs on at the lowest priority
    (`compile_pool.py`), so cheap grammars pass slow ones. A compile cannot be stopped once it
    runs, so it ends in the background and its grammar is cached for the next request; one that
    has not started when its last client leaves, times out or is refused is dropped.
    Compiled grammars (and refusals) are cached by their text, LRU, within `cache_bytes`."""

    def __init__(
        self,
        tokenizer: Any,
        stop_ids: Collection[int],
        vocab_size: int | None = None,
        cache_size: int = 128,
        cache_bytes: int = 256 * 2**20,
        timeout: float = 10.0,
        max_in_flight: int = 16,
        threads: int = 0,
        quantum: float = QUANTUM_SECONDS,
    ) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self.vocab_size = self.info.vocab_size
        self.stop_ids = tuple(sorted(stop_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._cache_size, self._cache_bytes, self._cached_bytes = cache_size, cache_bytes, 0
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses), for tests and metrics
        self.timeout, self.max_in_flight = timeout, max_in_flight
        self.in_flight = 0  # compiles running or waiting for a thread
        # per grammar compiling: its job and how many requests wait for it
        self._pending: dict[tuple[str, str], _Pending] = {}
        self.pool = CompilePool(
            threads or default_threads(), quantum, COMPILE_NICENESS, "grammar-compile"
        )

    async def compile_async(self, grammar: Grammar) -> Any:
        """`compile` on the pool, bounded in time and in compiles at once (see the class).
        Requests for a grammar already compiling wait for that compile, not a second one."""
        key = (grammar.kind, grammar.text)
        hit = self._cached(key)
        if hit is not None:
            return _result(hit)
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:
                if self.in_flight >= self.max_in_flight:
                    raise Overloaded(
                        f"{self.in_flight} grammars are being compiled, the most this server "
                        "compiles at once: retry later"
                    )
                self.in_flight += 1
                pending = self._pending[key] = _Pending(
                    self.pool.submit(partial(self.compile, grammar))
                )
                pending.job.done.add_done_callback(partial(self._finished, key))
            pending.waiters += 1
        try:
            return await self._wait(pending.job, grammar.param)
        finally:
            with self._lock:
                pending.waiters -= 1
                abandoned = pending.waiters == 0
            if abandoned:  # nobody waits: a compile not yet started is dropped (its done
                self.pool.cancel(pending.job)  # callback takes the lock: called outside it)

    async def _wait(self, job: Job[Any], param: str) -> Any:
        """The job's grammar: its start awaited for `timeout` s at most (else Overloaded), then
        its end until `timeout` s after it started (else InvalidRequest)."""
        try:
            began = await asyncio.wait_for(_awaitable(job.started), self.timeout)
        except TimeoutError:
            raise Overloaded(
                f"the server is busy compiling other requests' grammars: '{param}' waited "
                f"{self.timeout:g} s and its compile has not started; retry later"
            ) from None
        left = began + self.timeout - time.monotonic()
        try:
            return await asyncio.wait_for(_awaitable(job.done), max(left, 0.0))
        except TimeoutError:  # the wait ended; the compile runs on in the background
            raise InvalidRequest(
                f"'{param}' is too complex: compiling it took longer than {self.timeout:g} s",
                param=param,
            ) from None

    def _finished(self, key: tuple[str, str], _: Future[Any]) -> None:
        with self._lock:
            self.in_flight -= 1
            self._pending.pop(key, None)

    def close(self) -> None:
        self.pool.close()

    def _cached(self, key: tuple[str, str]) -> Any:
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                return None
            self._cache.move_to_end(key)
            return hit[0]

    def compile(self, grammar: Grammar) -> Any:
        """The compiled grammar (xgr.CompiledGrammar), blocking; InvalidRequest naming
        grammar.param (also when the same grammar was refused before: refusals are cached)."""
        key = (grammar.kind, grammar.text)
        hit = self._cached(key)
        if hit is not None:
            return _result(hit)
        try:
            compiled: Any = self._compile(grammar)
            size = int(compiled.memory_size_bytes) + len(grammar.text)
        except InvalidRequest as refused:
            compiled, size = refused, len(grammar.text)
        with self._lock:
            self.compiled += 1
            if key not in self._cache:
                self._cache[key] = (compiled, size)
                self._cached_bytes += size
            while self._cache and (
                len(self._cache) > self._cache_size or self._cached_bytes > self._cache_bytes
            ):
                _, (_, gone) = self._cache.popitem(last=False)
                self._cached_bytes -= gone
        return _result(compiled)

    def _compile(self, grammar: Grammar) -> Any:
        """Built, checked for an empty language, compiled, checked that some token begins it;
        InvalidRequest naming grammar.param at each step."""
        param = grammar.param
        if len(grammar.text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(
                f"'{param}' is {len(grammar.text)} characters; at most {MAX_GRAMMAR_CHARS}",
                param=param,
            )
        try:
            built = _build(grammar)
        except InvalidRequest:
            raise
        except Exception as exc:  # xgrammar's parse errors say what is wrong: pass it on
            raise InvalidRequest(
                f"'{param}' cannot be enforced: {library_message(exc)}", param=param
            ) from exc
        empty = empty_rule(str(built))
        if empty is not None:
            rule = f": its rule '{empty}' derives no text" if grammar.kind == "ebnf" else ""
            raise InvalidRequest(f"no text satisfies '{param}'{rule}", param=param)
        try:
            compiled = self._compiler.compile_grammar(built)
        except Exception as exc:
            raise InvalidRequest(
                f"'{param}' cannot be enforced: {library_message(exc)}", param=param
            ) from exc
        if not self._can_begin(compiled):
            raise InvalidRequest(f"no text satisfies '{param}': no token can begin it", param=param)
        return compiled

    def _can_begin(self, compiled: Any) -> bool:
        """Whether the grammar allows some first token (or ending at once)."""
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

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
