"""Prompt and response records: one per request, sent as a CloudEvent, never on a hot path.

Opt-in (`--log-payloads hash|full`, `--payload-logger-url`): the record holds the request's ids,
tenant, model, protocol, parameters, usage, latencies and finish reason, and the prompt and the
response as full text (`full`) or as their SHA-256 hashes (`hash`: the monitoring can match and
count them without reading them). Streamed answers are recorded whole when they end.

The sink is any HTTP CloudEvents receiver, e.g. the URL a KServe InferenceService's `logger`
names (manifests/overlays/payload-logger): KServe's own logger sees only raw HTTP bodies, never
a stream's text. Records go out in CloudEvents' binary mode (the `ce-*` headers, the record as
the JSON body), one POST each, from a thread of their own with a bounded queue; a full queue or
a failed POST drops the record and counts it (`predictor_payload_records_dropped_total`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx

log = logging.getLogger(__name__)

EVENT_TYPE = "org.gptq-predictor.inference.record"
MAX_QUEUE = 1024
MAX_BACKOFF = 30.0  # seconds between tries while the sink is unreachable
POST_TIMEOUT = 5.0


def payload_field(text: str, mode: str) -> str | dict[str, str]:
    """The prompt or response as the mode records it: the text, or its hash."""
    if mode == "full":
        return text
    return {"sha256": hashlib.sha256(text.encode()).hexdigest()}


def prompt_text(prompt: str, messages: Any, prompt_ids: Any) -> str:
    """What was asked, as one text: the prompt, a chat's messages as JSON, or token ids."""
    if messages is not None:
        return json.dumps(list(messages), ensure_ascii=False, sort_keys=True, default=str)
    if prompt_ids is not None:
        return json.dumps(list(prompt_ids))
    return prompt


class PayloadLog:
    """Records to a CloudEvents sink, from a bounded queue on a thread of their own."""

    def __init__(
        self,
        url: str,
        mode: str,
        source: str,
        on_drop: Callable[[int], None],
        max_queue: int = MAX_QUEUE,
    ) -> None:
        self.mode = mode
        self._url = url
        self._source = source
        self._on_drop = on_drop
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(max_queue)
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="payload-log", daemon=True)
        self._thread.start()

    def submit(self, record: dict[str, Any]) -> None:
        with self._idle:
            self._pending += 1
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._done(dropped=True)

    def _done(self, dropped: bool) -> None:
        if dropped:
            self._on_drop(1)
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _run(self) -> None:
        """Post each record; while the sink is unreachable, drop (and count) records without
        trying, retrying after 1, 2, 4 ... 30 s, and say so once an outage: a connection
        attempt and a logged warning a request cost the server's CPU (a share of its tokens/s
        large enough to see, load/bench_tracing.py) for records that were lost anyway."""
        backoff, retry_at = 0.0, 0.0
        with httpx.Client(timeout=POST_TIMEOUT) as client:
            while (record := self._queue.get()) is not None:
                if time.monotonic() < retry_at:
                    self._done(dropped=True)
                    continue
                error = None
                try:
                    answer = client.post(
                        self._url, headers=self._headers(record), content=json.dumps(record)
                    )
                    if not answer.is_success:
                        log.warning("payload sink answered %d", answer.status_code)
                    ok = answer.is_success
                except httpx.HTTPError as exc:
                    error, ok = exc, False
                if error is not None:
                    if not backoff:
                        log.warning(
                            "payload sink unreachable, records dropped (counted) until "
                            "it answers: %s",
                            error,
                        )
                    backoff = min(MAX_BACKOFF, max(1.0, 2 * backoff))
                    retry_at = time.monotonic() + backoff
                elif backoff:
                    log.info("payload sink answers again")
                    backoff = 0.0
                self._done(dropped=not ok)

    def _headers(self, record: dict[str, Any]) -> dict[str, str]:
        return {
            "ce-specversion": "1.0",
            "ce-id": f"{record['id']}-{uuid.uuid4().hex[:8]}",
            "ce-source": self._source,
            "ce-type": EVENT_TYPE,
            "ce-time": datetime.fromtimestamp(time.time(), UTC).isoformat(),
            "content-type": "application/json",
        }

    def flush(self, timeout: float = 30.0) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def shutdown(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(POST_TIMEOUT + 1.0)
