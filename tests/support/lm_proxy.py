"""What the test lm:// proxies share: forward every connection to a server on 127.0.0.1, byte for
byte, reading the client's requests (186-byte headers, a PUT's payload after its header) so that
a subclass can act on each one before it is sent (`before_send`) and after (`after_send`).

A proxy binds 127.0.0.1 on a port the kernel hands out and prints that port as its first stdout
line (`serve_forever`).
"""

from __future__ import annotations

import socket
import struct
import threading

REQUEST = struct.Struct("<9i150s")
PUT, GET = 1, 2


class ForwardingProxy:
    def __init__(self, upstream_port: int, log_path: str) -> None:
        self.upstream_port = upstream_port
        self.log_path = log_path
        self.lock = threading.Lock()
        self.num_accepted = 0

    def log(self, line: str) -> None:
        with self.lock, open(self.log_path, "a") as f:
            f.write(line + "\n")

    def before_send(self, index: int, state: dict, command: int, key: bytes, head: bytes) -> bytes:
        """Called for each request of connection `index` (`state`: that connection's own dict);
        returns the header to send. Default: the header as it came."""
        return head

    def after_send(self, index: int, state: dict, command: int, key: bytes) -> None:
        """Called once the request went to the server."""

    def client_to_server(self, index: int, client: socket.socket, server: socket.socket) -> None:
        state: dict = {}
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
                server.sendall(self.before_send(index, state, command, key, head) + payload)
                self.after_send(index, state, command, key)
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

    def serve_forever(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        print(listener.getsockname()[1], flush=True)
        while True:
            client, _ = listener.accept()
            self.serve(client)


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
