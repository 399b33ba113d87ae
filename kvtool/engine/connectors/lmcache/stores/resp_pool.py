"""The raw RESP connections of a Redis-protocol store (resp_wire.py), and the two ways chunks travel
over them: pipelined GET waves straight into the callers' buffers, and SETs from the callers' memory.

A store holds `connections` connection sets for GETs and as many for SETs, so a long load never
holds up a store or the reverse. A set has one connection per node its keys reached (one for a
single server, up to one per master of a cluster) and serves one thread at a time: a stripe of a
GET wave holds one for the whole wave, a PUT item for its commands.

GET waves: stripe g takes items g, g+N, ... (as resp_base's `striped` does) and keeps the GETs of
up to GET_WINDOW items in flight on its set, each GET on the connection of the node that owns its
key. Replies are read in the order they were asked for, each item's in full before the next's: a
layout reads what it wants (`ItemReplies`) and `finish` reads past the rest, so an item refused
after its metadata leaves every connection in step for the next. An item redirected by a cluster
(`-MOVED`: the slot map is reloaded; `-ASK`: `ASKING` on the named node) is sent again once.

Failures: an error reply fails its item and keeps the connections. A connection that breaks or
misses a deadline is dropped with the whole set (its stream position is unknown); the items
whose replies were in flight are sent again on fresh connections. The item that met the break
is retried once, within its own deadline; one that missed its deadline is not, and the items of
the same call not sent yet fail at once, so a store that stops answering costs one deadline per
call, not one per chunk.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader
from kvtool.engine.connectors.lmcache.stores.resp_wire import (
    Endpoint,
    Redirect,
    ReplyError,
    RespConnection,
    command,
    parse_redirect,
)
from kvtool.engine.connectors.lmcache.stores.store import Buffer, StoreAddress
from kvtool.engine.errors import KVToolError, PeerError

T = TypeVar("T")
Result = ChunkHeader | KVToolError | None
# Items whose GETs are in flight on one stripe: the server writes the next item's replies while
# the stripe reads one, and a slow stripe holds few items of a wave.
GET_WINDOW = 2


class ConnectionSet:
    """One connection per node, created as keys reach the node; used by one thread at a time."""

    def __init__(self, address: StoreAddress) -> None:
        self.address = address
        self.conns: dict[Endpoint, RespConnection] = {}

    def to(self, endpoint: Endpoint) -> RespConnection:
        conn = self.conns.get(endpoint)
        if conn is None:
            conn = self.conns[endpoint] = RespConnection(endpoint, self.address)
        return conn

    def drop(self) -> None:
        for conn in self.conns.values():
            conn.drop()

    def shut(self) -> None:
        for conn in list(self.conns.values()):
            conn.shut()


class PendingGet:
    """One item of a GET wave: its keys, where its payload goes, and where its GETs went."""

    __slots__ = ("index", "key", "keys", "target", "expected", "deadline", "retried", "asked", "sent", "admitted")

    def __init__(self, index: int, key: str, keys: tuple[str, ...], target: memoryview,
                 expected: ChunkHeader | None) -> None:
        self.index, self.key, self.keys, self.target, self.expected = index, key, keys, target, expected
        self.deadline: float | None = None  # time.monotonic() seconds; set when first sent
        self.retried = False  # sent again once already (a broken connection or a redirect)
        self.asked: dict[str, Endpoint] = {}  # key -> the node an -ASK named, for the next send
        self.sent: list[tuple[RespConnection, bool]] = []  # per key: its connection, ASKING first
        self.admitted = False  # before_item was called


class ItemReplies:
    """The replies to one item's GETs, read in the order of its keys.

    For key i, `size(i)` reads the reply's header (None: no such key); then `body(i)` or
    `body_into(i, view)` reads its body, or the layout leaves it to `finish`, which reads past
    every reply the layout did not read. An error reply raises ReplyError (its redirect, if
    any, is kept in `redirects`).
    """

    def __init__(self, item: PendingGet) -> None:
        self.item = item
        self.deadline: float = item.deadline  # type: ignore[assignment]
        self.next = 0  # the first key whose reply header is unread
        self.unread: tuple[RespConnection, int] | None = None  # a body whose header was read
        self.redirects: dict[int, Redirect] = {}

    def size(self, i: int) -> int | None:
        self._skip_to(i)
        conn, asking = self.item.sent[i]
        self.next = i + 1
        if asking:
            try:
                conn.expect_ok("ASKING", self.deadline)
            except ReplyError:
                conn.drop()  # the GET's own reply is still due: out of step
                raise
        try:
            n = conn.read_header("GET", self.deadline)
        except ReplyError as e:
            redirect = parse_redirect(e.text, conn.host)
            if redirect is not None:
                self.redirects[i] = redirect
            raise
        if n is not None:
            self.unread = (conn, n)
        return n

    def body_into(self, i: int, view: memoryview) -> None:
        conn, n = self._body_of(i)
        if len(view) != n:
            raise ValueError(f"body of {n} bytes into a view of {len(view)}")
        conn.read_body_into(view, self.deadline)

    def body(self, i: int) -> bytes:
        conn, n = self._body_of(i)
        data = bytearray(n)
        conn.read_body_into(memoryview(data), self.deadline)
        return bytes(data)

    def finish(self) -> None:
        """Read past whatever of this item's replies is still unread."""
        self._skip_to(len(self.item.keys))

    def _body_of(self, i: int) -> tuple[RespConnection, int]:
        if self.unread is None or self.next != i + 1:
            raise ValueError(f"no unread body for key {i}")
        body, self.unread = self.unread, None
        return body

    def _skip_to(self, i: int) -> None:
        self._discard()
        while self.next < i:
            try:
                self.size(self.next)
            except ReplyError:
                pass
            self._discard()

    def _discard(self) -> None:
        if self.unread is not None:
            (conn, n), self.unread = self.unread, None
            conn.discard_body(n, self.deadline)


class RawPool:
    """The raw connection sets of one store (connected lazily) and the operations that use them.

    Args:
        url: the store's address without credentials, for messages.
        address: where and as whom to connect (user, password, database, TLS options).
        connections: connection sets per direction (stripes of a GET wave).
        timeout_s: deadline of each operation (one item's GETs, one PUT item's SETs).
        route: the node that owns a key. May raise KVToolError (a slot map that cannot be read).
        reroute: forget what `route` knows (a redirect or a broken connection said it is stale).
        error: one line for a failure of `what` (ReplyError, OSError).
        on_threads: runs `run(0) ... run(n - 1)` each on a thread of its own and waits for them.
    """

    def __init__(
        self, url: str, address: StoreAddress, *, connections: int, timeout_s: float,
        route: Callable[[str], Endpoint], reroute: Callable[[], None],
        error: Callable[[BaseException, str], KVToolError], on_threads: Callable[[int, Callable[[int], None]], None],
    ) -> None:
        self.url = url
        self.num_connections = connections
        self.timeout_s = timeout_s
        self.route, self.reroute, self.error, self.on_threads = route, reroute, error, on_threads
        self._all = [ConnectionSet(address) for _ in range(2 * connections)]
        self._gets: queue.Queue[ConnectionSet] = queue.Queue()
        self._sets: queue.Queue[ConnectionSet] = queue.Queue()
        for i, cset in enumerate(self._all):
            (self._gets if i < connections else self._sets).put(cset)
        self.closed = False

    def _checkout(self, free: queue.Queue[ConnectionSet], deadline: float, what: str) -> ConnectionSet:
        if self.closed:
            raise PeerError(f"{self.url}: store is closed")
        try:
            return free.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise PeerError(f"{self.url}: {what} failed: timed out waiting for a free connection") from None

    def _reroute(self) -> KVToolError | None:
        try:
            self.reroute()
        except KVToolError as e:
            return e
        return None

    # -- SETs -------------------------------------------------------------------------------------

    def execute(self, what: str, body: Callable[[Callable[..., None]], T]) -> T:
        """`body(ok)` on a connection set under one deadline, where `ok(key, *args)` sends one
        command to the node owning `key` and reads its `+OK`. Retried once on a broken connection.

        Raises:
            PeerError / ConfigError: as `error` words the failure (never a partial answer).
        """
        deadline = time.monotonic() + self.timeout_s
        cset = self._checkout(self._sets, deadline, what)
        try:
            for attempt in (0, 1):
                try:
                    return body(lambda key, *args: self._ok(cset, key, args, deadline))
                except ReplyError as e:  # the connections are still in step
                    raise self.error(e, what) from None
                except OSError as e:
                    cset.drop()
                    if isinstance(e, socket.timeout) or attempt or self.closed:
                        raise self.error(e, what) from None
                    stale = self._reroute()
                    if stale is not None:
                        raise stale from None
            raise AssertionError("unreachable")
        except Exception as e:
            if not isinstance(e, KVToolError):
                cset.drop()  # a reply may be half read
            raise
        finally:
            self._sets.put(cset)

    def _ok(self, cset: ConnectionSet, key: str, args: tuple[str | Buffer, ...], deadline: float) -> None:
        name = str(args[0])
        asked: Endpoint | None = None
        for attempt in (0, 1):
            conn = cset.to(asked if asked is not None else self.route(key))
            conn.send(deadline, (command("ASKING") if asked is not None else []) + command(*args))
            try:
                if asked is not None:
                    conn.expect_ok("ASKING", deadline)
            except ReplyError:
                conn.drop()  # the command's own reply is still due: out of step
                raise
            try:
                conn.expect_ok(name, deadline)
                return
            except ReplyError as e:
                redirect = parse_redirect(e.text, conn.host)
                # A moved slot, or a Sentinel master demoted to a replica: the routes are stale.
                stale = (redirect is not None and redirect.kind == "MOVED") or e.text.startswith("READONLY")
                if attempt or not (redirect is not None or stale):
                    raise
                if stale:
                    error = self._reroute()
                    if error is not None:
                        raise error from None
                    asked = None
                else:
                    asked = redirect.endpoint  # type: ignore[union-attr]

    # -- GET waves --------------------------------------------------------------------------------

    def get_wave(
        self,
        items: Sequence[tuple[str, Buffer, ChunkHeader | None]],
        keys_of: Callable[[str], tuple[str, ...]],
        read_item: Callable[[PendingGet, ItemReplies], ChunkHeader | None],
        on_result: Callable[[int, Result], None] | None = None,
        before_item: Callable[[int], None] | None = None,
    ) -> list[Result]:
        """Every item into its buffer (RemoteStore.get_many_into), striped and pipelined; errors per item."""
        results: list[Result] = [None] * len(items)
        num_stripes = min(self.num_connections, len(items))
        timed_out = threading.Event()  # one GET of the call missed its deadline: the rest fail at once

        def finish(item: PendingGet, result: Result) -> None:
            results[item.index] = result
            if on_result is not None:
                on_result(item.index, result)

        def run_stripe(g: int) -> None:
            stripe = deque(
                PendingGet(i, items[i][0], keys_of(items[i][0]), memoryview(items[i][1]).cast("B"), items[i][2])
                for i in range(g, len(items), num_stripes)
            )
            try:
                cset = self._checkout(self._gets, time.monotonic() + self.timeout_s, "GET")
            except PeerError as e:
                for item in stripe:
                    finish(item, e)
                return
            try:
                self._pipeline(cset, stripe, read_item, finish, before_item, timed_out)
            except BaseException:
                cset.drop()  # replies may still be on their way: out of step
                raise
            finally:
                self._gets.put(cset)

        self.on_threads(num_stripes, run_stripe)
        return results

    def _pipeline(
        self, cset: ConnectionSet, pending: deque[PendingGet],
        read_item: Callable[[PendingGet, ItemReplies], ChunkHeader | None],
        finish: Callable[[PendingGet, Result], None], before_item: Callable[[int], None] | None,
        timed_out: threading.Event,
    ) -> None:
        window: deque[PendingGet] = deque()  # sent, replies not read yet; oldest first
        while pending or window:
            while len(window) < GET_WINDOW and pending:
                item = pending.popleft()
                if self.closed or timed_out.is_set():
                    why = "store is closed" if self.closed else f"another GET timed out after {self.timeout_s:g} s"
                    finish(item, PeerError(f"{self.url}: GET not sent: {why}"))
                    continue
                if item.deadline is None:
                    item.deadline = time.monotonic() + self.timeout_s
                try:
                    self._send(cset, item)
                except KVToolError as e:  # no route (a slot map that could not be read)
                    finish(item, e)
                    continue
                except ReplyError as e:  # AUTH or SELECT refused while connecting
                    self._resend(cset, window, pending)
                    finish(item, self.error(e, "GET"))
                    continue
                except OSError as e:
                    self._broken(cset, item, window, pending, e, finish, timed_out)
                    continue
                window.append(item)
            if not window:
                return
            item = window.popleft()
            if not item.admitted:
                item.admitted = True
                if before_item is not None:
                    before_item(item.index)
            replies = ItemReplies(item)
            try:
                try:
                    result = read_item(item, replies)
                finally:
                    replies.finish()
            except ReplyError as e:  # the connections are still in step
                if replies.redirects and not item.retried:
                    self._redirected(item, replies.redirects, pending, finish)
                else:
                    finish(item, self.error(e, "GET"))
                continue
            except KVToolError as e:
                finish(item, e)
                continue
            except OSError as e:
                self._broken(cset, item, window, pending, e, finish, timed_out)
                continue
            finish(item, result)

    def _send(self, cset: ConnectionSet, item: PendingGet) -> None:
        """The item's GETs, each to the node owning its key (or the one an -ASK named)."""
        asked, item.asked = item.asked, {}
        batches: dict[int, tuple[RespConnection, list[Buffer]]] = {}
        item.sent = []
        for key in item.keys:
            endpoint = asked.get(key)
            conn = cset.to(endpoint if endpoint is not None else self.route(key))
            parts = batches.setdefault(id(conn), (conn, []))[1]
            if endpoint is not None:
                parts += command("ASKING")
            parts += command("GET", key)
            item.sent.append((conn, endpoint is not None))
        for conn, parts in batches.values():
            conn.send(item.deadline, parts)  # type: ignore[arg-type]

    def _redirected(self, item: PendingGet, redirects: dict[int, Redirect], pending: deque[PendingGet],
                    finish: Callable[[PendingGet, Result], None]) -> None:
        """Send `item` again, once: after reloading the slot map (MOVED), or to the named node (ASK)."""
        item.retried = True
        if any(r.kind == "MOVED" for r in redirects.values()):
            stale = self._reroute()
            if stale is not None:
                finish(item, stale)
                return
        item.asked = {item.keys[i]: r.endpoint for i, r in redirects.items() if r.kind == "ASK"}
        pending.appendleft(item)

    @staticmethod
    def _resend(cset: ConnectionSet, window: deque[PendingGet], pending: deque[PendingGet]) -> None:
        """Drop the set: the window's GETs go out again on fresh connections, each with a deadline of its own."""
        cset.drop()
        for item in window:
            item.deadline = None
        pending.extendleft(reversed(window))
        window.clear()

    def _broken(
        self, cset: ConnectionSet, item: PendingGet, window: deque[PendingGet], pending: deque[PendingGet],
        error: OSError, finish: Callable[[PendingGet, Result], None], timed_out: threading.Event,
    ) -> None:
        """`item` met a broken connection or its deadline: resend the window, then retry or fail `item`."""
        self._resend(cset, window, pending)
        if isinstance(error, socket.timeout):
            timed_out.set()
            finish(item, self.error(error, "GET"))
        elif self.closed:
            finish(item, PeerError(f"{self.url}: GET failed: store is closed"))
        elif not item.retried:
            item.retried = True  # within its own deadline; the server may have restarted
            stale = self._reroute()
            if stale is not None:
                finish(item, stale)
            else:
                pending.appendleft(item)
        else:
            finish(item, self.error(error, "GET"))

    def close(self) -> None:
        """Wake every call blocked on a socket; `drop_all` closes them once the calls returned."""
        self.closed = True
        for cset in self._all:
            cset.shut()

    def drop_all(self) -> None:
        for cset in self._all:
            cset.drop()
