"""One connection of the lm:// client: a socket connected lazily, every blocking call under the
operation's deadline.

Before every send and recv the socket timeout is recomputed from a monotonic deadline, so a peer
that trickles one byte every few seconds cannot stretch an operation past it. Payloads are read
with the socket's receive low-water mark raised (`RCVLOWAT_BYTES`), so a large payload wakes the
reader a few times rather than once per segment.

LMCache's server writes a reply's header and its payload in two sends, and each pipelined reply
in its own, without TCP_NODELAY: Nagle's algorithm holds each small write until the previous one
is acknowledged. A client that delays its ACKs (Linux does, for a peer it talks to in turns)
then costs about 40 ms per GET of a small payload and per batch of EXISTs. So on Linux the
client acknowledges at once (TCP_QUICKACK, which the kernel clears again: it is set after every
send and every read).
"""

from __future__ import annotations

import socket
import sys
import time

from kvtool.engine.connectors.lmcache.stores.protocol import RESPONSE, Buffer, Reply, unpack_reply

# Payloads are read in pieces of at least this many bytes (SO_RCVLOWAT, lowered for a payload's
# last piece): fewer wake-ups, polls and recv calls per payload. On an H200 host, GETs of 37 MB
# chunks into the pages, A/B runs alternating on one engine: 2 MiB read faster than any amount,
# than 1 or 8 MiB, and (over four connections) than one blocking recv(MSG_WAITALL) per payload;
# 4 MiB about the same (docs/benchmarks/, 2026-12-04).
RCVLOWAT_BYTES = 0 if sys.platform == "win32" else 2 << 20  # 0: any amount
QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux only


class DeadlineExceeded(socket.timeout):
    """The operation's deadline passed (before or during a socket call)."""


def _remaining(deadline: float) -> float:
    """Seconds left before `deadline` (monotonic); DeadlineExceeded once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("timed out")
    return left


class OwnedSocket:
    """A socket one thread uses at a time and another may wake: `shut` unblocks a call waiting
    on it, `drop` closes it (after a failure the stream position is unknown, so the socket is
    useless)."""

    sock: socket.socket | None = None

    def drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def shut(self) -> None:
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Connection(OwnedSocket):
    """One pool slot: a socket (connected lazily) and a reusable reply buffer.

    Every call takes the operation's `deadline` (time.monotonic() seconds): the socket's
    timeout is set to what is left of it before each blocking call.
    """

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.sock: socket.socket | None = None
        self.lowat = 1  # the socket's SO_RCVLOWAT
        self.reply_buf = bytearray(RESPONSE.size)
        self.num_requests = 0  # since connect; 0 means a failure cannot be a stale socket

    def ensure(self, deadline: float) -> socket.socket:
        if self.sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=_remaining(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers are tiny
            self.sock, self.num_requests, self.lowat = sock, 0, 1
        return self.sock

    def send(self, deadline: float, *parts: Buffer) -> None:
        sock = self.ensure(deadline)
        # sendall's timeout bounds the whole call (not each partial send).
        if len(parts) > 1 and sum(memoryview(p).nbytes for p in parts) <= 65536:
            sock.settimeout(_remaining(deadline))
            sock.sendall(b"".join(parts))  # one segment for small messages
        else:
            for part in parts:
                sock.settimeout(_remaining(deadline))
                sock.sendall(part)
        self.num_requests += 1
        _ack_at_once(sock)

    def recv_into(self, view: memoryview, deadline: float) -> None:
        """Fill `view` exactly before `deadline`; a closed stream is an error."""
        sock = self.sock
        if sock is None:
            raise ConnectionError("not connected")
        got, n = 0, len(view)
        while got < n:
            left = _remaining(deadline)
            lowat = max(1, min(RCVLOWAT_BYTES, n - got))
            if lowat != self.lowat:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                self.lowat = lowat
            sock.settimeout(left)
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError("connection closed by the server")
            got += k
            _ack_at_once(sock)

    def recv_reply(self, deadline: float) -> Reply:
        self.recv_into(memoryview(self.reply_buf), deadline)
        return unpack_reply(self.reply_buf)


def _ack_at_once(sock: socket.socket) -> None:
    """Acknowledge what has arrived now and, until the kernel clears it, what arrives next."""
    if QUICKACK is not None:
        sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)


def describe_error(e: OSError) -> str:
    """An OSError of a socket call in a few words, for a one-line PeerError."""
    if isinstance(e, socket.timeout):
        return "timed out"
    return str(e) or type(e).__name__
