"""The lm:// client: a pool of connections to one LMCache server, every wait under a deadline.

Each operation (EXIST, GET, PUT and its confirming EXIST, HEALTH) has one deadline for the whole
exchange, connect included, which each `connection.Connection` holds every socket call to, so a
peer that trickles one byte every few seconds cannot stretch an operation past `timeout_s`. A peer that misses a deadline is unhealthy for `backoff_s`: every
call in that time fails at once instead of waiting out a timeout of its own, so a silent server
costs one timeout, not one per chunk. `close()` shuts every socket down first, so no call in
flight outlives it.

The server closes the socket on any bad input and keeps no per-connection state, so a failed
request closes its connection and the next use of that pool slot reconnects.

Threading: an `LMClient` is safe to share between threads. It holds two lanes of `connections`
sockets each, one for reads (EXIST, GET, HEALTH) and one for writes (PUT), as the Redis stores
hold GET and SET sets (resp_pool.py): a store of many chunks holds its connections until the
last is confirmed, and a step's loads queued behind it would wait as long. Each call checks a
socket of its lane out for its whole request/reply exchange. `put_many` stripes items over the
write lane; `get_many_into` pipelines over the read lane: each connection takes the next
unclaimed item whenever its window of GET_WINDOW requests in flight has room, so a slow
connection holds at most that many items of a wave while the others carry the rest.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvtool.engine.connectors.lmcache.stores.connection import Connection, describe_error
from kvtool.engine.connectors.lmcache.stores.protocol import (
    HEALTH_KEY,
    Buffer,
    ChunkHeader,
    Command,
    ReplyCode,
    exist_code,
    pack_request,
    parse_lm_url,
    refuse_reply,
)
from kvtool.engine.errors import ConfigError, KVToolError, PeerError

logger = logging.getLogger(__name__)

# Requests per write when pipelining: keeps both directions' socket buffers far from full, so
# neither side can block on send while the other does.
PIPELINE_DEPTH = 256
# GETs in flight on one connection: the server starts on the next reply while the client reads
# one, and a slow connection holds no more than this many items of a wave.
GET_WINDOW = 2
DEFAULT_BACKOFF_S = 10.0
T = TypeVar("T")
ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


class _GetItem:
    """One GET of a pipelined wave: its request, where its payload goes, and its deadline once sent."""

    __slots__ = ("index", "request", "target", "capacity", "expected", "deadline", "retried")

    def __init__(self, index: int, request: bytes, target: memoryview, capacity: int,
                 expected: ChunkHeader | None) -> None:
        self.index, self.request, self.target = index, request, target
        self.capacity, self.expected = capacity, expected
        self.deadline: float | None = None  # time.monotonic() seconds; set when first sent
        self.retried = False


class _Lane:
    """The sockets of one direction (reads or writes) and the threads that drive them."""

    def __init__(self, host: str, port: int, connections: int, name: str) -> None:
        self.name = name
        # FIFO: consecutive checkouts rotate through the pool, so stripes land on distinct sockets.
        self.pool: queue.Queue[Connection] = queue.Queue()
        self.all = [Connection(host, port) for _ in range(connections)]
        for conn in self.all:
            self.pool.put(conn)
        self.executor: ThreadPoolExecutor | None = None
        self.executor_lock = threading.Lock()


class LMClient:
    """A client of one LMCache `lm://` server, with `connections` sockets for reads and as many
    for writes.

    Args:
        host, port: the server (see `parse_lm_url`).
        connections: the size of each lane; `put_many` splits its items into this many stripes,
            each on its own connection and thread; `get_many_into` pipelines over as many.
        timeout_s: the deadline of one whole operation (connect, request, every reply byte).
        backoff_s: after a missed deadline, how long every call fails at once (0: never).

    Every call that talks to the server raises `PeerError` (one line) when the server cannot be
    reached, closes the connection, replies with something malformed, misses the deadline, or
    is in its back-off period. A request that fails on a connection that already served
    requests is retried once on a fresh one, within the same deadline: the server may have been
    restarted since. Nothing is connected until the first request.
    """

    def __init__(
        self, host: str, port: int, connections: int = 4, timeout_s: float = 10.0,
        backoff_s: float = DEFAULT_BACKOFF_S,
    ):
        if connections < 1:
            raise ConfigError(f"lm:// connections must be >= 1, got {connections}")
        if not timeout_s > 0:
            raise ConfigError(f"lm:// timeout_s must be > 0, got {timeout_s}")
        self.host, self.port = host, port
        self.num_connections = connections
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self._reads = _Lane(host, port, connections, "lm-read")
        self._writes = _Lane(host, port, connections, "lm-write")
        self._closed = False
        # time.monotonic() until which the peer counts as unhealthy (a missed deadline).
        self._unhealthy_until = 0.0

    @classmethod
    def from_url(cls, url: str, connections: int = 4, timeout_s: float = 10.0) -> LMClient:
        """An `LMClient` for `lm://HOST:PORT`."""
        host, port = parse_lm_url(url)
        return cls(host, port, connections=connections, timeout_s=timeout_s)

    @property
    def url(self) -> str:
        return f"lm://{self.host}:{self.port}"

    def num_open_connections(self) -> int:
        """How many pool sockets are connected right now (for stats and tests)."""
        return sum(conn.sock is not None for lane in (self._reads, self._writes) for conn in lane.all)

    @property
    def is_backing_off(self) -> bool:
        """True while calls fail fast after a missed deadline."""
        return time.monotonic() < self._unhealthy_until

    # -- plumbing: checkout, one exchange with retry, stripes ------------------------------------

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _refuse_if_backing_off(self, what: str) -> None:
        left = self._unhealthy_until - time.monotonic()
        if left > 0:
            raise PeerError(
                f"{self.url}: {what} not sent: the server missed a deadline; retrying in {left:.1f} s"
            )

    def _checkout(self, lane: _Lane, deadline: float, what: str) -> Connection:
        if self._closed:
            raise PeerError(f"{self.url}: client is closed")
        try:
            return lane.pool.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise PeerError(f"{self.url}: {what} failed: timed out waiting for a free connection") from None

    def _exchange(self, conn: Connection, what: str, exchange: Callable[[Connection, float], T]) -> T:
        """Run one request/reply `exchange` on `conn` under one deadline; retry once if `conn` was stale."""
        self._refuse_if_backing_off(what)
        deadline = self._deadline()
        for attempt in (0, 1):
            reused = conn.sock is not None and conn.num_requests > 0
            try:
                return exchange(conn, deadline)
            except KVToolError:
                conn.drop()  # a refused reply leaves its body unread: the stream is unusable
                raise
            except OSError as e:  # timeouts, resets, refused connects, ConnectionError
                conn.drop()
                if isinstance(e, socket.timeout):
                    if self.backoff_s > 0:
                        self._unhealthy_until = time.monotonic() + self.backoff_s
                    raise PeerError(
                        f"{self.url}: {what} failed: timed out: no complete answer within {self.timeout_s:g} s"
                    ) from None
                if self._closed:
                    raise PeerError(f"{self.url}: {what} failed: client is closed") from None
                # A reset or EOF on a socket that served requests before may only mean that the
                # server restarted since; a timeout says nothing of the kind, so it is not retried.
                if attempt == 0 and reused:
                    continue
                raise PeerError(f"{self.url}: {what} failed: {describe_error(e)}") from None
        raise AssertionError("unreachable")

    def _run(self, what: str, exchange: Callable[[Connection, float], T]) -> T:
        """One exchange on a read connection."""
        self._refuse_if_backing_off(what)
        conn = self._checkout(self._reads, self._deadline(), what)
        try:
            return self._exchange(conn, what, exchange)
        finally:
            self._reads.pool.put(conn)

    def _striped(self, lane: _Lane, items: Sequence[ItemT], one: Callable[[Connection, ItemT], ResultT]) -> list[ResultT]:
        """`one(conn, item)` for every item: stripe g holds items g, g+N, ... on one connection of `lane`."""
        results: list[ResultT] = [None] * len(items)  # type: ignore[list-item]
        num_stripes = min(self.num_connections, len(items))

        def run_stripe(g: int) -> None:
            conn = self._checkout(lane, self._deadline(), "a transfer")
            try:
                for i in range(g, len(items), num_stripes):
                    results[i] = one(conn, items[i])
            finally:
                lane.pool.put(conn)

        self._on_threads(lane, num_stripes, run_stripe)
        return results

    def _on_threads(self, lane: _Lane, n: int, run: Callable[[int], None]) -> None:
        """run(0) ... run(n - 1), each on a pool thread (inline when n is 1); re-raises what they raise."""
        if n <= 1:
            if n:
                run(0)
            return
        with lane.executor_lock:
            if self._closed:
                raise PeerError(f"{self.url}: client is closed")
            if lane.executor is None:
                lane.executor = ThreadPoolExecutor(self.num_connections, thread_name_prefix=lane.name)
            executor = lane.executor
        for future in [executor.submit(run, g) for g in range(n)]:
            future.result()

    # -- requests ---------------------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server answers HEALTH with 200 within the deadline; False otherwise."""

        def exchange(conn: Connection, deadline: float) -> bool:
            conn.send(deadline, pack_request(Command.HEALTH, HEALTH_KEY))
            return conn.recv_reply(deadline).code == ReplyCode.SUCCESS

        try:
            return self._run("HEALTH", exchange)
        except PeerError:
            return False

    def exists(self, key: str) -> bool:
        """Whether the server holds `key` (one EXIST). Raises PeerError on failure."""
        return self.exist_many([key])[0]

    def exist_many(self, keys: Sequence[str]) -> list[bool]:
        """EXIST for each key, pipelined on one connection under one deadline; answers in order.

        Raises PeerError on failure (no partial answer is returned).
        """
        requests = [pack_request(Command.EXIST, k) for k in keys]

        def exchange(conn: Connection, deadline: float) -> list[bool]:
            found: list[bool] = []
            for i in range(0, len(requests), PIPELINE_DEPTH):
                batch = requests[i : i + PIPELINE_DEPTH]
                conn.send(deadline, b"".join(batch))
                for _ in batch:
                    found.append(exist_code(conn.recv_reply(deadline)))
            return found

        return self._run("EXIST", exchange) if requests else []

    def put(self, key: str, payload: Buffer, fmt: int, dtype_code: int, shape: Sequence[int]) -> None:
        """Store `payload` under `key`; return only once the server confirms it holds the key.

        PUT has no reply, so an EXIST on the same connection follows it: the server handles one
        connection's requests in order, so its 200 proves that this PUT was stored. The PUT and
        its confirmation share one deadline.

        Args:
            payload: the chunk bytes, any C-contiguous buffer (see `tensor_buffer`); not copied.
            fmt, dtype_code, shape: announced as given; the server does not check them.

        Raises:
            PeerError: the transfer failed or the EXIST did not find the key.
        """
        self._refuse_if_backing_off("PUT")
        conn = self._checkout(self._writes, self._deadline(), "PUT")
        try:
            self._put_on(conn, key, payload, fmt, dtype_code, shape)
        finally:
            self._writes.pool.put(conn)

    def _put_on(
        self, conn: Connection, key: str, payload: Buffer, fmt: int, dtype_code: int, shape: Sequence[int]
    ) -> None:
        view = memoryview(payload).cast("B")
        header = pack_request(Command.PUT, key, view.nbytes, fmt, dtype_code, shape)
        confirm = pack_request(Command.EXIST, key)

        def exchange(c: Connection, deadline: float) -> bool:
            c.send(deadline, header, view, confirm)
            return exist_code(c.recv_reply(deadline))

        if not self._exchange(conn, "PUT", exchange):
            raise PeerError(f"{self.url}: PUT of {key} was not stored")

    def put_many(self, items: Sequence[tuple[str, Buffer, ChunkHeader]]) -> list[bool]:
        """`put` each `(key, payload, header)`, striped over the pool; True where confirmed.

        A failed item is logged and reported as False; it does not stop the others (once the
        server missed a deadline, the rest fail at once).

        Raises:
            ConfigError: a payload's size differs from its `header.length` (checked up front).
        """
        for key, payload, header in items:
            if memoryview(payload).nbytes != header.length:
                num_bytes = memoryview(payload).nbytes
                raise ConfigError(f"payload of {key} is {num_bytes} bytes, its header says {header.length}")
        warned = threading.Event()

        def put_one(conn: Connection, item: tuple[str, Buffer, ChunkHeader]) -> bool:
            key, payload, header = item
            try:
                self._put_on(conn, key, payload, header.fmt, header.dtype_code, header.shape)
                return True
            except PeerError as e:
                if not warned.is_set():  # one line per batch, not one per chunk
                    warned.set()
                    logger.warning("%s", e)
                return False

        return self._striped(self._writes, items, put_one)

    def get_into(self, key: str, buf: Buffer, expected: ChunkHeader | None = None) -> ChunkHeader | None:
        """GET `key` straight into `buf`; the chunk's header on a hit, None on a miss.

        Args:
            buf: a writable buffer, e.g. `tensor_buffer` of a (pinned) host tensor. The payload
                fills its first `header.length` bytes; nothing else is allocated.
            expected: if given, the reply must match it exactly (fmt, dtype, shape, length).

        Raises:
            PeerError: transfer failure, a missed deadline, or a malformed reply or impossible
                length; then no payload byte is read and the connection is dropped.
            KVRefused: a well-formed reply that is not `expected`.
        """
        self._refuse_if_backing_off("GET")
        conn = self._checkout(self._reads, self._deadline(), "GET")
        try:
            return self._get_on(conn, key, buf, expected)
        finally:
            self._reads.pool.put(conn)

    def _get_on(
        self, conn: Connection, key: str, buf: Buffer, expected: ChunkHeader | None
    ) -> ChunkHeader | None:
        target = memoryview(buf).cast("B")
        if target.readonly:
            raise ValueError("get_into needs a writable buffer")
        request = pack_request(Command.GET, key)
        capacity = target.nbytes if expected is None else min(target.nbytes, expected.length)

        def exchange(c: Connection, deadline: float) -> ChunkHeader | None:
            c.send(deadline, request)
            header = refuse_reply(c.recv_reply(deadline), capacity, expected)
            if header is not None and header.length:
                c.recv_into(target[: header.length], deadline)
            return header

        return self._exchange(conn, "GET", exchange)

    def get_many_into(
        self,
        items: Sequence[tuple[str, Buffer, ChunkHeader | None]],
        on_result: Callable[[int, ChunkHeader | KVToolError | None], None] | None = None,
        before_item: Callable[[int], None] | None = None,
    ) -> list[ChunkHeader | KVToolError | None]:
        """`get_into` each `(key, buf, expected)`, pipelined over the pool.

        Each connection claims the next item in order whenever fewer than GET_WINDOW of its GETs
        are in flight, so items go to whichever connection is free: a slow one never holds up
        more than its window. Returns, per item in order: its header on a hit, None on a miss,
        or the error (PeerError or KVRefused, returned, not raised) of an item that failed, so
        that one bad chunk leaves the others' results usable. `on_result(i, result)` is called
        as each item ends (from a pool thread), so a caller can consume chunks while the rest
        are still arriving; `before_item(i)` just before item i's reply is read into its buffer
        (its request may already be sent), so a caller can recycle a ring of buffers. Each
        item has its own deadline from its send; after a missed one, the remaining items fail
        at once. An item whose connection failed under another item is sent again on a fresh
        connection; one that fails on a connection that served requests before is retried
        once, within its deadline (the server may have restarted).
        """
        results: list[ChunkHeader | KVToolError | None] = [None] * len(items)
        lock = threading.Lock()
        claimed = 0

        def claim() -> _GetItem | None:
            nonlocal claimed
            with lock:
                if claimed >= len(items):
                    return None
                i, claimed = claimed, claimed + 1
            key, buf, expected = items[i]
            target = memoryview(buf).cast("B")
            if target.readonly:
                raise ValueError("get_into needs a writable buffer")
            capacity = target.nbytes if expected is None else min(target.nbytes, expected.length)
            return _GetItem(i, pack_request(Command.GET, key), target, capacity, expected)

        def finish(item: _GetItem, result: ChunkHeader | KVToolError | None) -> None:
            results[item.index] = result
            if on_result is not None:
                on_result(item.index, result)

        def run_connection(_: int) -> None:
            conn = self._checkout(self._reads, self._deadline(), "a transfer")
            try:
                self._pipeline_gets(conn, claim, finish, before_item)
            except BaseException:
                conn.drop()  # replies may still be on their way: the stream is unusable
                raise
            finally:
                self._reads.pool.put(conn)

        self._on_threads(self._reads, min(self.num_connections, len(items)), run_connection)
        return results

    def _pipeline_gets(
        self,
        conn: Connection,
        claim: Callable[[], _GetItem | None],
        finish: Callable[[_GetItem, ChunkHeader | KVToolError | None], None],
        before_item: Callable[[int], None] | None,
    ) -> None:
        """GETs on one connection, up to GET_WINDOW in flight, until no item is left to claim."""
        window: deque[_GetItem] = deque()  # sent, reply not read yet; oldest first
        resend: deque[_GetItem] = deque()  # sent on a connection that failed since
        while True:
            while len(window) < GET_WINDOW:
                item = resend.popleft() if resend else claim()
                if item is None:
                    break
                try:
                    if self._closed:
                        raise PeerError(f"{self.url}: GET failed: client is closed")
                    self._refuse_if_backing_off("GET")
                    if item.deadline is None:
                        item.deadline = self._deadline()
                    conn.send(item.deadline, item.request)
                except PeerError as e:
                    finish(item, e)
                    continue
                except OSError as e:
                    self._get_connection_failed(conn, item, window, resend, e, finish, sent=False)
                    continue
                window.append(item)
            if not window:
                return
            item = window.popleft()
            try:
                if before_item is not None:
                    before_item(item.index)
                header = refuse_reply(conn.recv_reply(item.deadline), item.capacity, item.expected)
                if header is not None and header.length:
                    conn.recv_into(item.target[: header.length], item.deadline)
            except KVToolError as e:
                conn.drop()  # a refused reply leaves its body unread: the stream is unusable
                self._requeue(window, resend)
                finish(item, e)
                continue
            except OSError as e:
                self._get_connection_failed(conn, item, window, resend, e, finish, sent=True)
                continue
            finish(item, header)

    @staticmethod
    def _requeue(window: deque[_GetItem], resend: deque[_GetItem]) -> None:
        """The window's GETs went down with their connection: send them again, each with a new deadline."""
        for item in window:
            item.deadline = None
        resend.extend(window)
        window.clear()

    def _get_connection_failed(
        self, conn: Connection, item: _GetItem, window: deque[_GetItem], resend: deque[_GetItem],
        error: OSError, finish: Callable[[_GetItem, ChunkHeader | KVToolError | None], None], *, sent: bool,
    ) -> None:
        """`item` failed on `conn` with `error`: drop the connection, then retry, fail or resend as `_exchange` does."""
        # Requests on this socket that were answered: a reset there may only mean a restart.
        answered = conn.num_requests - len(window) - sent if conn.sock is not None else 0
        conn.drop()
        self._requeue(window, resend)
        if isinstance(error, socket.timeout):
            if self.backoff_s > 0:
                self._unhealthy_until = time.monotonic() + self.backoff_s
            finish(item, PeerError(
                f"{self.url}: GET failed: timed out: no complete answer within {self.timeout_s:g} s"))
        elif self._closed:
            finish(item, PeerError(f"{self.url}: GET failed: client is closed"))
        elif answered > 0 and not item.retried:
            item.retried = True  # within its own deadline
            resend.appendleft(item)
        else:
            finish(item, PeerError(f"{self.url}: GET failed: {describe_error(error)}"))

    def close(self) -> None:
        """Close every connection and the stripe threads; bounded whatever the server does.

        Sockets are shut down first, so a call blocked in another thread returns at once (with
        a PeerError) instead of running out its deadline.
        """
        self._closed = True
        lanes = (self._reads, self._writes)
        for lane in lanes:
            for conn in lane.all:
                conn.shut()
        for lane in lanes:
            with lane.executor_lock:
                if lane.executor is not None:
                    lane.executor.shutdown(wait=True)
                    lane.executor = None
        for lane in lanes:
            for conn in lane.all:
                conn.drop()

    def __enter__(self) -> LMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

