"""An lm:// proxy for tests that stalls one connection, run as its own process.

    python tests/support/stalling_lm_proxy.py UPSTREAM_PORT --release-after N --fallback-s S --log FILE

It forwards every connection to a real LMCache server on 127.0.0.1:UPSTREAM_PORT, byte for
byte, and reads the client's requests (186-byte headers, a PUT's payload after its header) to
see which are GETs. The first connection to send a GET is the slow one: from that GET on, its
requests are held back until the other connections together have forwarded N GETs (logged
`released by count`), or, so that a client that never gets there cannot hang, until S seconds
have passed (logged `released by timeout`). Every forwarded GET is logged as `GET slow` or
`GET <connection number>`. The first stdout line is the port.
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import threading

REQUEST = struct.Struct("<9i150s")
GET = 2
PUT = 1


class Proxy:
    def __init__(self, upstream_port: int, release_after: int, fallback_s: float, log_path: str) -> None:
        self.upstream_port = upstream_port
        self.release_after = release_after
        self.fallback_s = fallback_s
        self.log_path = log_path
        self.lock = threading.Lock()
        self.released = threading.Event()
        self.other_gets = 0
        self.num_accepted = 0
        self.slow: int | None = None  # the connection that sent the first GET

    def log(self, line: str) -> None:
        with self.lock, open(self.log_path, "a") as f:
            f.write(line + "\n")

    def is_slow(self, index: int) -> bool:
        """Whether connection `index` is the slow one (the first to ask, at its first GET)."""
        with self.lock:
            if self.slow is None:
                self.slow = index
            return self.slow == index

    def forwarded_get(self, index: int, slow: bool) -> None:
        self.log("GET slow" if slow else f"GET {index}")
        if slow:
            return
        with self.lock:
            self.other_gets += 1
            due = self.other_gets >= self.release_after and not self.released.is_set()
            if due:
                self.released.set()
        if due:
            self.log("released by count")

    def hold(self) -> None:
        if not self.released.wait(self.fallback_s):
            self.released.set()
            self.log("released by timeout")

    def client_to_server(self, index: int, client: socket.socket, server: socket.socket) -> None:
        slow = held = False
        try:
            while True:
                head = recv_exact(client, REQUEST.size)
                if head is None:
                    return
                command, length = REQUEST.unpack(head)[:2]
                payload = recv_exact(client, length) if command == PUT and length > 0 else b""
                if payload is None:
                    return
                if command == GET and not held:
                    held = True  # this connection's first GET: the slow one holds it back
                    slow = self.is_slow(index)
                    if slow:
                        self.hold()
                server.sendall(head + payload)
                if command == GET:
                    self.forwarded_get(index, slow)
        except OSError:
            return
        finally:
            shut(server)

    def server_to_client(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while True:
                data = server.recv(1 << 20)
                if not data:
                    return
                client.sendall(data)
        except OSError:
            return
        finally:
            shut(client)

    def serve(self, client: socket.socket) -> None:
        with self.lock:
            index = self.num_accepted
            self.num_accepted += 1
        server = socket.create_connection(("127.0.0.1", self.upstream_port))
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self.client_to_server, args=(index, client, server), daemon=True).start()
        threading.Thread(target=self.server_to_client, args=(client, server), daemon=True).start()


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("--release-after", type=int, required=True)
    parser.add_argument("--fallback-s", type=float, default=30.0)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    proxy = Proxy(args.upstream_port, args.release_after, args.fallback_s, args.log)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    print(listener.getsockname()[1], flush=True)
    while True:
        client, _ = listener.accept()
        proxy.serve(client)


if __name__ == "__main__":
    sys.exit(main())
