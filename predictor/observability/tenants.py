"""The tenant label: who a request is for, bounded so that a client cannot grow /metrics.

A request's tenant is a gateway's tenant header (`--tenant-header`) or OpenAI's `user` field.
The first `--max-tenant-labels` distinct tenants keep their own label; later ones are counted as
`other`, and requests without a tenant as `none`. Called on the event loop only.
"""

from __future__ import annotations

NO_TENANT = "none"
OTHER_TENANTS = "other"


class TenantLabels:
    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def label(self, tenant: str | None) -> str:
        if not tenant:
            return NO_TENANT
        if tenant in self._seen:
            return tenant
        if len(self._seen) < self._limit and tenant not in (NO_TENANT, OTHER_TENANTS):
            self._seen.add(tenant)
            return tenant
        return OTHER_TENANTS
