"""One raw Redis-protocol (RESP2) connection for chunk payloads: commands written from the caller's
buffers, bulk replies read straight into the caller's buffers.

redis-py parses every reply in Python and returns a bytes object, which a store then copies into
its staging buffer: a Python parse and two copies of every multi-megabyte chunk. This connection
writes a command's large arguments as they are (`sendmsg` over the header, the payload's own
memoryview and the trailer), reads reply header lines (`$<len>`, `+OK`, `-ERR ...`) through a small
buffer, and reads a bulk string's body with `recv_into` into the target view, then its `\\r\\n`.
Lookups, PING, cluster slot maps and Sentinel discovery stay with redis-py (resp_base.py).

Every blocking call takes the operation's deadline (time.monotonic() seconds) and sets the
socket's timeout to what is left of it (connection.py's rule), so a server that trickles bytes
cannot stretch an operation past its deadline. A reply read only in part (a timeout, a reset, a
malformed line) leaves the stream position unknown: the caller drops the connection.

Connecting: TCP (TCP_NODELAY), a unix socket, or TLS over TCP with the rediss:// options built
into an `ssl.SSLContext` the way redis-py builds it; then `AUTH [user] password` and `SELECT db`
when the address names them, their replies checked before the connection carries anything else.
"""

from __future__ import annotations

import socket
import ssl
from typing import Union

import msgspec

from kvtool.engine.connectors.lmcache.stores.connection import RCVLOWAT_BYTES, OwnedSocket, _remaining
from kvtool.engine.connectors.lmcache.stores.store import Buffer, StoreAddress

# A TCP endpoint (host, port) or a unix socket path.
Endpoint = Union[tuple[str, int], str]
# Reply header lines and small replies are read through a buffer of this size; a bulk body is
# read past it, straight into its target.
READ_BUFFER_BYTES = 64 << 10
# Command arguments up to this size are joined into the command's header; larger ones are sent
# from their own memory.
INLINE_BYTES = 16 << 10
# redis-py's SSLConnection defaults for the rediss:// options (store.SSL_OPTIONS) that have one.
_SSL_DEFAULTS = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}


class ProtocolError(ConnectionError):
    """The server sent something that is not the RESP reply expected: the stream is unusable."""


class ReplyError(Exception):
    """An error reply (`-ERR ...`, `-NOAUTH ...`) to `command`; the stream itself is still in step."""

    def __init__(self, command: str, text: str) -> None:
        super().__init__(text)
        self.command = command
        self.text = text

    @property
    def refuses_credentials(self) -> bool:
        return self.command == "AUTH" or self.text.split(" ", 1)[0] in ("NOAUTH", "WRONGPASS")


class Redirect(msgspec.Struct, frozen=True):
    """A cluster node's `-MOVED slot host:port` or `-ASK slot host:port` reply."""

    kind: str  # "MOVED" or "ASK"
    slot: int
    endpoint: tuple[str, int]


def parse_redirect(text: str, default_host: str) -> Redirect | None:
    """The redirect an error reply names, or None for any other error (an empty host is the replying node's)."""
    parts = text.split(" ")
    if len(parts) != 3 or parts[0] not in ("MOVED", "ASK"):
        return None
    host, _, port = parts[2].rpartition(":")
    try:
        return Redirect(parts[0], int(parts[1]), (host or default_host, int(port)))
    except ValueError:
        return None


def command(*args: str | Buffer) -> list[Buffer]:
    """One command as a RESP array: small pieces joined, large arguments left in their own memory."""
    parts: list[Buffer] = []
    head = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else memoryview(arg).cast("B")
        size = len(data)
        head.append(b"$%d\r\n" % size)
        if size > INLINE_BYTES:
            parts += [b"".join(head), data]
            head = [b"\r\n"]
        else:
            head += [data, b"\r\n"]
    parts.append(b"".join(head))
    return parts


def ssl_context(query: dict) -> ssl.SSLContext:
    """The TLS context of a rediss:// address: its options (store.SSL_OPTIONS) as redis-py reads them.

    Raises:
        ssl.SSLError / OSError: a certificate or key that cannot be loaded.
        ProtocolError: an option value redis-py refuses (an unknown ssl_cert_reqs).
    """
    from redis.asyncio.connection import RedisSSLContext
    from redis.exceptions import RedisError

    options = {**_SSL_DEFAULTS, **query}
    check = options["ssl_check_hostname"]
    if isinstance(check, str):
        check = check.lower() in ("1", "true", "yes")
    try:
        return RedisSSLContext(
            keyfile=options.get("ssl_keyfile"), certfile=options.get("ssl_certfile"),
            cert_reqs=options["ssl_cert_reqs"], ca_certs=options.get("ssl_ca_certs"),
            ca_path=options.get("ssl_ca_path"), check_hostname=check,
        ).get()
    except RedisError as e:
        raise ProtocolError(str(e)) from None


class RespConnection(OwnedSocket):
    """A socket to one Redis node (connected, authenticated and on its database lazily) and the
    buffer its reply lines are read through.

    Args:
        endpoint: (host, port), or a unix socket path.
        address: the store's address: its user, password and database, and for rediss:// its
            TLS options.
    """

    def __init__(self, endpoint: Endpoint, address: StoreAddress) -> None:
        self.endpoint = endpoint
        self.address = address
        self.sock: socket.socket | None = None
        self._buf = bytearray(READ_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the buffered bytes not consumed yet
        self._lowat = 1  # the socket's SO_RCVLOWAT; raised only for the body reads of plain TCP
        self._tunable = False  # plain TCP: SO_RCVLOWAT applies

    @property
    def host(self) -> str:
        return self.endpoint[0] if isinstance(self.endpoint, tuple) else "localhost"

    # -- connecting ------------------------------------------------------------------------------

    def ensure(self, deadline: float) -> socket.socket:
        """The connected socket; connects, authenticates and selects the database first if needed."""
        if self.sock is None:
            self.sock = self._connect(deadline)
            self._start = self._end = 0
            self._lowat = 1
            try:
                self._handshake(deadline)
            except BaseException:
                self.drop()
                raise
        return self.sock

    def _connect(self, deadline: float) -> socket.socket:
        if isinstance(self.endpoint, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(_remaining(deadline))
                sock.connect(self.endpoint)
            except BaseException:
                sock.close()
                raise
            self._tunable = False
            return sock
        tls = self.address.scheme == "rediss"
        context = ssl_context(self.address.query) if tls else None
        sock = socket.create_connection(self.endpoint, timeout=_remaining(deadline))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._tunable = not tls
            if context is not None:
                sock.settimeout(_remaining(deadline))  # bounds the handshake
                sock = context.wrap_socket(sock, server_hostname=self.endpoint[0])
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, deadline: float) -> None:
        a = self.address
        steps: list[tuple[str, list[Buffer]]] = []
        if a.password is not None:
            user = [a.username] if a.username else []
            steps.append(("AUTH", command("AUTH", *user, a.password)))
        if a.db:
            steps.append(("SELECT", command("SELECT", str(a.db))))
        if not steps:
            return
        self.send(deadline, [p for _, parts in steps for p in parts])
        for name, _ in steps:
            self.expect_ok(name, deadline)

    def drop(self) -> None:
        """Close after a failure or when done: whatever was unread is gone with the socket."""
        super().drop()
        self._start = self._end = 0

    # -- writing ---------------------------------------------------------------------------------

    def send(self, deadline: float, parts: list[Buffer]) -> None:
        """Write `parts` in order before `deadline`, each from its own memory."""
        sock = self.ensure(deadline)
        if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS
            for part in parts:
                sock.settimeout(_remaining(deadline))
                sock.sendall(part)
            return
        views = [memoryview(p).cast("B") for p in parts]
        first = 0
        while True:
            while first < len(views) and not len(views[first]):
                first += 1
            if first == len(views):
                return
            sock.settimeout(_remaining(deadline))
            sent = sock.sendmsg(views[first : first + 512])
            while sent:
                n = len(views[first])
                if sent >= n:
                    sent -= n
                    first += 1
                else:
                    views[first] = views[first][sent:]
                    sent = 0

    # -- reading ---------------------------------------------------------------------------------

    def _recv_into(self, view: memoryview, deadline: float, lowat: int) -> int:
        sock = self.sock
        if sock is None:
            raise ConnectionError("not connected")
        if self._tunable and lowat != self._lowat:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self._lowat = lowat
        sock.settimeout(_remaining(deadline))
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("connection closed by the server")
        return n

    def _fill(self, deadline: float) -> None:
        """Read what has arrived (at least one byte) behind the buffered bytes."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            kept = self._end - self._start
            if kept == len(self._buf):
                raise ProtocolError(f"reply line longer than {READ_BUFFER_BYTES} bytes")
            self._buf[:kept] = self._buf[self._start : self._end]
            self._start, self._end = 0, kept
        self._end += self._recv_into(self._view[self._end :], deadline, 1)

    def _line(self, deadline: float) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start : i])
                self._start = i + 2
                return line
            self._fill(deadline)

    def _crlf(self, deadline: float) -> None:
        while self._end - self._start < 2:
            self._fill(deadline)
        if self._view[self._start : self._start + 2] != b"\r\n":
            raise ProtocolError("bulk reply not terminated by CRLF")
        self._start += 2

    def read_header(self, name: str, deadline: float) -> int | None:
        """The length of the bulk reply to `name` (its body not read yet); None for `$-1` (no such key).

        Raises:
            ReplyError: an error reply (the stream stays in step).
            ProtocolError: any other reply.
        """
        line = self._line(deadline)
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise ReplyError(name, rest.decode(errors="replace"))
        if kind != b"$":
            raise ProtocolError(f"{name}: expected a bulk reply, got {line[:40]!r}")
        try:
            size = int(rest)
        except ValueError:
            raise ProtocolError(f"{name}: bad bulk length {rest[:40]!r}") from None
        return None if size < 0 else size

    def read_body_into(self, view: memoryview, deadline: float) -> None:
        """The body of the bulk reply whose header was just read, exactly `len(view)` bytes, into `view`."""
        n = len(view)
        got = min(n, self._end - self._start)
        if got:
            view[:got] = self._view[self._start : self._start + got]
            self._start += got
        while got < n:
            got += self._recv_into(view[got:], deadline, max(1, min(RCVLOWAT_BYTES, n - got)))
        self._crlf(deadline)

    def discard_body(self, size: int, deadline: float) -> None:
        """Read past the body of `size` bytes whose header was just read (a reply refused or not wanted)."""
        left = size
        while left:
            if self._start == self._end:
                self._start = self._end = 0
                self._fill(deadline)
            take = min(left, self._end - self._start)
            self._start += take
            left -= take
        self._crlf(deadline)

    def read_value(self, name: str, deadline: float) -> bytes | None:
        """A whole small bulk reply (header and body) as bytes; None for `$-1`."""
        size = self.read_header(name, deadline)
        if size is None:
            return None
        body = bytearray(size)
        self.read_body_into(memoryview(body), deadline)
        return bytes(body)

    def expect_ok(self, name: str, deadline: float) -> None:
        """Read the `+OK` that `name` answers. Raises ReplyError for an error reply."""
        line = self._line(deadline)
        if line[:1] == b"-":
            raise ReplyError(name, line[1:].decode(errors="replace"))
        if line != b"+OK":
            raise ProtocolError(f"{name}: expected +OK, got {line[:40]!r}")
