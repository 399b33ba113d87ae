"""The zmq side of KV events: vLLM's ZmqEventPublisher protocol, on a thread of its own.

Wire (vLLM 0.33, `ZmqEventPublisher`):
- PUB socket, multipart `(topic, seq, payload)`: `seq` an 8-byte big-endian counter from 0, one
  per batch; `payload` the msgpack EventBatch.
- ROUTER replay socket (optional): a request `(identity, b"", start_seq as 8 bytes big-endian)`,
  typically from a DEALER/REQ; the answer is every buffered batch with `seq >= start_seq` as
  `(identity, b"", topic, seq, payload)`, then the end marker `(identity, b"", b"", seq -1, b"")`.
  The buffer keeps the last `buffer_steps` batches.

The engine thread only encodes and enqueues (`publish`); the thread does all socket work. A
full queue drops the batch rather than stall the engine: its sequence number is taken at
enqueue time, so subscribers see the gap, and replay cannot fill it (`num_dropped_batches`).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque

import msgspec
import zmq

from kvtool.engine.errors import ConfigError
from kvtool.engine.events.config import KVEventsConfig
from kvtool.engine.events.kv_events import EventBatch, KVEventStream

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.1


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard hosts and ipc:// / inproc:// bind, anything else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket + optional ROUTER replay socket, both owned by one background thread."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped_batches = 0
        # zmq errors the thread survived (the engine never sees them; tests and stats may).
        self.num_send_errors = 0
        self.num_replay_errors = 0
        # Batches handed to publish() so far: the next one gets this sequence number.
        self.num_batches = 0
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            # The endpoints as bound (a `tcp://host:*` port resolved) or connected.
            self.endpoint = self._open(self._pub, config.endpoint, "endpoint")
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A full replay plus its end marker must fit (vLLM's sizing).
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self.replay_endpoint = self._open(self._replay, config.replay_endpoint, "replay_endpoint", bind_only=True)
        except BaseException:
            self._close_sockets()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(sock: zmq.Socket, endpoint: str, name: str, bind_only: bool = False) -> str:
        try:
            if bind_only or is_bind_endpoint(endpoint):
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as e:
            raise ConfigError(f"--kv-events-config {name} {endpoint!r}: {e}") from None

    def publish(self, batch: EventBatch) -> None:
        """Encode `batch` and queue it for the thread; never blocks."""
        if not self._running:
            raise RuntimeError("the KV event publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        item = (next(self._seq), self._encoder.encode(batch))
        self.num_batches += 1
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.num_dropped_batches += 1

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (up to timeout_s), then close both sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
            except zmq.ZMQError:
                self.num_replay_errors += 1  # one subscriber's failed replay; keep publishing
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, payload = item
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                self.num_send_errors += 1  # still kept for replay below
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # not a replay request: nothing to answer
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def open_kv_event_stream(config: KVEventsConfig | None, block_size: int) -> KVEventStream | None:
    """The engine's event stream for `config`, its publisher bound; None when nothing is published.

    Raises ConfigError (one line) when an endpoint cannot be bound or connected.
    """
    if config is None or not config.publishes:
        return None
    return KVEventStream(config, block_size, ZmqEventPublisher(config))
