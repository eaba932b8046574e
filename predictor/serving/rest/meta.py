"""Binds each REST request's trace context and tenant header (`observability/context.py`) for
the request's task, before any route (ours or KServe's) runs."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from predictor.observability import context


class RequestMetaBinder:
    def __init__(self, app: ASGIApp, tenant_header: str) -> None:
        self.app = app
        self.tenant_header = tenant_header.lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        pairs = ((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"])
        token = context.bind(context.read(pairs, self.tenant_header))
        try:
            await self.app(scope, receive, send)
        finally:
            context.unbind(token)
