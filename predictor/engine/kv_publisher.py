"""KV events over ZeroMQ, as vLLM's `ZmqEventPublisher` sends them (kv_events.py makes them).

PUB socket (`endpoint`: bound where it has `*`, `::`, or is ipc:// or inproc://, else
connected): each batch is three frames, the topic's bytes, an 8-byte big-endian sequence number
(0, 1, ... per process) and the msgpack of the batch (`[ts, events, data_parallel_rank]`).
Optional ROUTER socket (`replay_endpoint`): a request frame holding a start sequence number (8
bytes big-endian; a REQ or DEALER client) is answered with every kept batch from that number on,
`[seq, payload]` each, then `[-1 as 8 signed bytes, b""]`; the last `buffer_steps` batches are
kept.

`publish` never blocks the step loop: a batch is appended to a deque of at most `max_queue_size`
(past that it is dropped and `on_drop` told: the metric predictor_kv_events_dropped_total), and
where the deque was empty one byte goes down a pipe. The publisher's thread sleeps in one poll,
GIL released, on that pipe and the replay socket, and empties the deque when woken: at most once
a step, while the step's forward pass has let go of the GIL. (A publisher woken on a timer
takes the GIL from the step loop hundreds of times a second, which costs tokens/s, with or
without a subscriber: load/RESULTS.md.) zmq is imported by `start`, only when events are on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack

from predictor.engine.kv_events import KVEventBatch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local endpoint, connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        on_drop: Callable[[], None] = lambda: None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._hwm = hwm
        self._on_drop = on_drop
        self._queue: deque[KVEventBatch] = deque()  # appended by the step loop, popped here
        self._max_queue = max_queue_size
        self._stopping = threading.Event()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._pub: Any = None
        self._replay: Any = None
        self._wake_read, self._wake_write = -1, -1  # the pipe that wakes the thread

    def start(self) -> None:
        """Open the sockets (here, so that a port in use stops the start) and the thread."""
        import zmq  # only when events are on

        context: Any = zmq.Context.instance()
        try:
            self._pub = context.socket(zmq.PUB)
            self._pub.set_hwm(self._hwm)
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            for sock in (self._pub, self._replay):
                if sock is not None:
                    sock.close(linger=0)
            raise OSError(
                f"KV events (--kv-events-config): cannot open {self.endpoint} / "
                f"{self.replay_endpoint}: {exc}"
            ) from exc
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)  # a full pipe has woken the thread already
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info(
            "KV events published on %s (replay: %s, topic %r)",
            self.endpoint,
            self.replay_endpoint or "none",
            self._topic.decode(),
        )

    def publish(self, batch: KVEventBatch) -> None:
        """Queue a batch for the thread (one producer: the step loop); a full queue drops it
        (counted). Never waits; wakes the thread only where the deque was empty."""
        if len(self._queue) >= self._max_queue:
            self._on_drop()
            return
        idle = not self._queue  # the thread drains the deque whole before it sleeps
        self._queue.append(batch)
        if idle:
            self._wake()

    def _wake(self) -> None:
        if self._wake_write < 0:  # not started: nothing to wake
            return
        with contextlib.suppress(BlockingIOError):  # bytes wait: the thread is woken already
            os.write(self._wake_write, b"\0")

    def stop(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close the sockets."""
        if self._thread is None:
            return
        self._stopping.set()
        self._wake()
        self._thread.join(timeout)
        self._thread = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)

    def _run(self) -> None:
        import zmq

        packer = msgpack.Packer()
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            stopping = self._stopping.is_set()
            while self._queue:
                self._send(packer, self._queue.popleft())
            if stopping:
                return
            ready = dict(poller.poll())  # no timeout: woken by a batch, a request or stop
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
            if self._replay is not None and self._replay in ready:
                try:
                    self._answer_replay()
                except Exception:  # a malformed request must not stop the events
                    log.exception("KV events: a replay request failed")

    def _send(self, packer: msgpack.Packer, batch: KVEventBatch) -> None:
        try:
            payload = packer.pack(batch.wire())
            self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1
        except Exception:  # the events go on; this batch is lost
            log.exception("KV events: a batch could not be sent")

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # [identity, b"", start]: a REQ or DEALER client's request
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
