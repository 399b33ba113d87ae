"""The lm:// connection acknowledges at once after every send and every read (Linux).

LMCache's server writes a reply's header and payload in two sends without TCP_NODELAY, so Nagle's
algorithm holds the second write until the first is acknowledged; a client that delays its ACK
then stalls each small GET and each batch of EXISTs by the delayed-ACK timer (about 40 ms). The
stall itself is a matter of time and lives in `scripts/bench-lmcache-get` (`lookup_ms_median`);
this checks the contract that prevents it, on a real TCP connection.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest

from kvtool.engine.connectors.lmcache.stores.connection import RCVLOWAT_BYTES, Connection

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_QUICKACK is Linux's")


class RecordingSocket:
    """A socket that logs its sends, reads and TCP_QUICKACK settings, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.log: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self._sock, name)

    def sendall(self, data) -> None:
        self.log.append("send")
        self._sock.sendall(data)

    def recv_into(self, view, n: int) -> int:
        self.log.append("read")
        return self._sock.recv_into(view, n)

    def setsockopt(self, level: int, option: int, value: int) -> None:
        if (level, option, value) == (socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1):
            self.log.append("ack")
        self._sock.setsockopt(level, option, value)


def serve_replies(listener: socket.socket, replies: list[list[bytes]]) -> None:
    """Accept one client; for each request, answer with the reply's writes, one send each."""
    conn, _ = listener.accept()
    with conn:
        for writes in replies:
            conn.recv(4096)
            for w in writes:
                conn.sendall(w)
                time.sleep(0.001)  # separate segments, as a server without TCP_NODELAY sends them


def test_every_send_and_every_read_is_followed_by_an_immediate_ack():
    header, small = b"h" * 28, b"p" * 1000
    big = b"b" * (RCVLOWAT_BYTES + 70_000)  # past the receive low-water mark
    replies = [[header, small], [header], [header], [header, big]]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = threading.Thread(target=serve_replies, args=(listener, replies), daemon=True)
        server.start()
        conn = Connection(*listener.getsockname()[:2])
        deadline = time.monotonic() + 30
        rec = RecordingSocket(conn.ensure(deadline))
        conn.sock = rec
        for writes in replies:
            conn.send(deadline, b"request")
            for w in writes:
                out = bytearray(len(w))
                conn.recv_into(memoryview(out), deadline)
                assert out == w
        conn.drop()
        server.join(timeout=30)
    log = rec.log
    assert log.count("send") == len(replies)
    assert log.count("read") >= sum(len(w) for w in replies)
    for i, event in enumerate(log):
        if event in ("send", "read"):
            assert log[i + 1 : i + 2] == ["ack"], f"{event} #{i} not followed by an ack: {log}"
