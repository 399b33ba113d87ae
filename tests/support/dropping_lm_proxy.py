"""An lm:// proxy for tests that loses chunks between a lookup and its GET, run as its own process.

    python tests/support/dropping_lm_proxy.py UPSTREAM_PORT --drop-file FILE --log FILE

It forwards every connection to an lm:// server on 127.0.0.1:UPSTREAM_PORT byte for byte, as a
server that evicted a chunk right after answering its EXIST would behave: a GET of a key listed
in `--drop-file` (one key per line, read at each GET) is answered "missing", while EXIST still
finds the chunk; a PUT of a key after it was dropped stores it again, and later GETs of it are served. The
GET is forwarded with its key replaced by one the server does not hold, so the reply keeps its
place among the connection's pipelined replies. Each dropped GET is logged as `dropped KEY`,
each PUT as `PUT KEY`. The first stdout line is the port.
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import threading

REQUEST = struct.Struct("<9i150s")
PUT, GET = 1, 2
GONE = b"kvtool-test@1@0@dropped@float32".ljust(150, b" ")


class Proxy:
    def __init__(self, upstream_port: int, drop_file: str, log_path: str) -> None:
        self.upstream_port = upstream_port
        self.drop_file = drop_file
        self.log_path = log_path
        self.lock = threading.Lock()
        self.was_dropped: set[bytes] = set()
        self.stored_again: set[bytes] = set()

    def log(self, line: str) -> None:
        with self.lock, open(self.log_path, "a") as f:
            f.write(line + "\n")

    def dropped(self, key: bytes) -> bool:
        try:
            with open(self.drop_file, "rb") as f:
                listed = {line.strip() for line in f}
        except FileNotFoundError:
            return False
        with self.lock:
            if key not in listed or key in self.stored_again:
                return False
            self.was_dropped.add(key)
            return True

    def client_to_server(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while True:
                head = recv_exact(client, REQUEST.size)
                if head is None:
                    return
                fields = REQUEST.unpack(head)
                command, length, key = fields[0], fields[1], fields[-1].rstrip(b" \0")
                payload = recv_exact(client, length) if command == PUT and length > 0 else b""
                if payload is None:
                    return
                if command == PUT:
                    with self.lock:
                        if key in self.was_dropped:
                            self.stored_again.add(key)
                    self.log(f"PUT {key.decode()}")
                elif command == GET and self.dropped(key):
                    self.log(f"dropped {key.decode()}")
                    head = REQUEST.pack(*fields[:-1], GONE)
                server.sendall(head + payload)
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
        server = socket.create_connection(("127.0.0.1", self.upstream_port))
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self.client_to_server, args=(client, server), daemon=True).start()
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
    parser.add_argument("--drop-file", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    proxy = Proxy(args.upstream_port, args.drop_file, args.log)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    print(listener.getsockname()[1], flush=True)
    while True:
        client, _ = listener.accept()
        proxy.serve(client)


if __name__ == "__main__":
    sys.exit(main())
