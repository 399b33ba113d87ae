"""An in-memory lm:// server, run as its own process, for the CUDA tests and scripts/gpu-bench.py
on machines where LMCache's own server cannot be installed.

    python tests/support/memory_lm_server.py

It answers PUT, GET, EXIST and HEALTH of LMCache's protocol (186-byte requests, 36-byte
replies) as LMCache's server does: a thread per connection, requests handled in order, a GET's
header and payload sent from memory with two `sendall`s. Payloads are read with `recv_into`
(LMCache's PUT path is slower; nothing measured here stores). It binds 127.0.0.1 on a port the
kernel hands out and prints that port as its first stdout line.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading

REQUEST = struct.Struct("<9i150s")
REPLY = struct.Struct("<9i")
PUT, GET, EXIST, HEALTH = 1, 2, 3, 5


def recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:], len(view) - got)
        if k == 0:
            raise ConnectionError("closed")
        got += k


def serve(conn: socket.socket, store: dict[bytes, tuple[tuple[int, ...], memoryview]], lock: threading.Lock) -> None:
    head = memoryview(bytearray(REQUEST.size))
    try:
        while True:
            recv_exact(conn, head)
            command, length, fmt, dtype, _, s0, s1, s2, s3, key = REQUEST.unpack(head)
            key = key.rstrip(b" \0")
            if command == PUT:
                payload = memoryview(bytearray(length))
                recv_exact(conn, payload)
                with lock:
                    store[key] = ((fmt, dtype, s0, s1, s2, s3), payload)
            elif command == GET:
                with lock:
                    hit = store.get(key)
                if hit is None:
                    conn.sendall(REPLY.pack(400, 0, 0, 0, 0, 0, 0, 0, 0))
                else:
                    (f, d, a, b, c, e), payload = hit
                    conn.sendall(REPLY.pack(200, len(payload), f, d, a, b, c, e, 0))
                    conn.sendall(payload)
            elif command == EXIST:
                with lock:
                    found = key in store
                conn.sendall(REPLY.pack(200 if found else 400, 0, 0, 0, 0, 0, 0, 0, 0))
            elif command == HEALTH:
                conn.sendall(REPLY.pack(200, 0, 0, 0, 0, 0, 0, 0, 0))
            else:
                return  # as LMCache's server does with what it cannot parse: close
    except OSError:
        pass
    finally:
        conn.close()


def main() -> None:
    store: dict[bytes, tuple[tuple[int, ...], memoryview]] = {}
    lock = threading.Lock()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn, store, lock), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
