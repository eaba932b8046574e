"""Health and metrics probes logged at DEBUG, not INFO.

Kubernetes probes a pod every few seconds and Prometheus scrapes it as often; each request wrote
three INFO lines (uvicorn's access line and KServe's two latency lines), so a quiet pod's log
was mostly probes. The access and trace records of those paths are demoted to DEBUG (shown when
those loggers are set to DEBUG); every other request still logs at INFO.
"""

from __future__ import annotations

import logging
import re

PROBE_LOGGERS = ("uvicorn.access", "kserve.trace")
# uvicorn.access: '... "GET /v2/health/ready HTTP/1.1" 200'; kserve.trace: 'kserve.io.metrics: ...'
_PROBE = re.compile(
    r'"(GET|HEAD) (/v2/health/(ready|live)|/v2/models/[^/ ]+(/versions/[^/ ]+)?/ready'
    r"|/v2|/v1/models/[^/ ]+|/metrics|/health)[ ?]"
    r"|^kserve\.io\.(v2\.health\.(ready|live)|v2\.models\.\S+\.ready|metrics|v2):"
)


class ProbesAtDebug(logging.Filter):
    """Demotes the records of probe and scrape requests to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not _PROBE.search(record.getMessage()):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_probes() -> None:
    """Install the filter on the access and trace loggers (idempotent). Filters stay on a
    logger when uvicorn or KServe configures logging later (dictConfig replaces handlers)."""
    for name in PROBE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ProbesAtDebug) for f in logger.filters):
            logger.addFilter(ProbesAtDebug())
