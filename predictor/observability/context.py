"""What a request's transport carries for observability, beside its body: the W3C trace
context (`traceparent`, `tracestate`) and the tenant header.

The transports bind it for the request's task: an ASGI middleware over every REST route
(`serving/rest/body.py`) and a gRPC interceptor over every RPC (`serving/rpc/interceptors.py`)
read the headers or metadata once; `observer.Observer` reads it where a request's event stream
starts, in the same task. A context variable, as OpenTelemetry's own instrumentations carry the
current trace, so no route or servicer passes headers along by hand.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar, Token
from dataclasses import dataclass

TRACE_HEADERS = frozenset({"traceparent", "tracestate"})


@dataclass(frozen=True)
class RequestMeta:
    trace: tuple[tuple[str, str], ...] = ()  # the trace context headers, as sent
    tenant: str | None = None  # the tenant header's value


_NONE = RequestMeta()
_current: ContextVar[RequestMeta | None] = ContextVar("request_meta", default=None)


def read(pairs: Iterable[tuple[str, str]], tenant_header: str) -> RequestMeta:
    """The request's meta from its headers or metadata (names in lower case, as HTTP/2 and
    ASGI give them); `tenant_header`: the header naming the tenant ("": none)."""
    trace: list[tuple[str, str]] = []
    tenant = None
    for name, value in pairs:
        if name in TRACE_HEADERS:
            trace.append((name, value))
        elif tenant_header and name == tenant_header and value:
            tenant = value
    return RequestMeta(tuple(trace), tenant)


def bind(meta: RequestMeta) -> Token[RequestMeta | None]:
    return _current.set(meta)


def unbind(token: Token[RequestMeta | None]) -> None:
    _current.reset(token)


def current() -> RequestMeta:
    return _current.get() or _NONE
