"""A deliberately broken lm:// server for tests, run as its own process.

    python tests/support/broken_lm_server.py MODE --trickle-s 2 --log FILE

It speaks enough of LMCache's protocol (186-byte requests, 36-byte replies) to misbehave in
one of these ways, per command:

    trickle         HEALTH, EXIST and GET replies go out one byte every `--trickle-s` seconds
    trickle-exist   HEALTH answers at once; EXIST replies trickle (a lookup that never ends)
    trickle-get     HEALTH and EXIST (always "present") answer at once; GET replies trickle
    trickle-payload as trickle-get, but GET answers a 2 MiB chunk: its header and half its
                    payload at once, the rest trickled
    silent          reads every request, never answers anything
    silent-get      HEALTH and EXIST (always "present") answer at once; GET is never answered
    lie             HEALTH and EXIST (always "present") answer at once; GET answers "missing"

A PUT's payload is read and dropped. Every request's command name is appended to `--log`, one
line each, so a test can count what reached the server. The first stdout line is the port.
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import threading
import time

REQUEST = struct.Struct("<9i150s")
RESPONSE = struct.Struct("<9i")
NAMES = {1: "PUT", 2: "GET", 3: "EXIST", 4: "LIST", 5: "HEALTH"}
# A GET hit's header for a tiny chunk; trickled, it never completes anyway.
GET_HIT = RESPONSE.pack(200, 16, 1, 4, 2, 1, 1, 2, 0)
OK = RESPONSE.pack(200, 0, 1, 2, 0, 0, 0, 0, 0)
# A GET hit for a 2 MiB chunk (float32 [2, 1, 1, 262144]): half its payload comes at once, the
# rest is trickled.
LARGE = 2 * 1024 * 1024
GET_LARGE = RESPONSE.pack(200, LARGE, 1, 4, 2, 1, 1, LARGE // 8, 0)
MISS = RESPONSE.pack(400, 0, 1, 2, 0, 0, 0, 0, 0)

# mode -> command -> (reply, trickled); a command missing from a mode is never answered.
BEHAVIOUR = {
    "trickle": {"HEALTH": (OK, True), "EXIST": (OK, True), "GET": (GET_HIT, True)},
    "trickle-exist": {"HEALTH": (OK, False), "EXIST": (OK, True), "GET": (MISS, False)},
    "trickle-get": {"HEALTH": (OK, False), "EXIST": (OK, False), "GET": (GET_HIT, True)},
    "trickle-payload": {"HEALTH": (OK, False), "EXIST": (OK, False), "GET": (GET_LARGE + bytes(LARGE), True)},
    "silent": {},
    "silent-get": {"HEALTH": (OK, False), "EXIST": (OK, False)},
    "lie": {"HEALTH": (OK, False), "EXIST": (OK, False), "GET": (MISS, False)},
}


def recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def serve(conn: socket.socket, mode: str, trickle_s: float, log_path: str, log_lock: threading.Lock) -> None:
    try:
        while True:
            head = recv_exact(conn, REQUEST.size)
            if head is None:
                return
            command, length = REQUEST.unpack(head)[:2]
            name = NAMES.get(command, str(command))
            with log_lock, open(log_path, "a") as log:
                log.write(name + "\n")
            if command == 1 and length > 0 and recv_exact(conn, length) is None:
                return
            behaviour = BEHAVIOUR[mode].get(name)
            if behaviour is None:
                continue  # silent: read on, answer nothing
            reply, trickled = behaviour
            if not trickled:
                conn.sendall(reply)
                continue
            sent = len(reply) // 2 if len(reply) > RESPONSE.size else 0
            conn.sendall(reply[:sent])
            for i in range(sent, len(reply)):
                conn.sendall(reply[i : i + 1])
                time.sleep(trickle_s)
    except OSError:
        return
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=sorted(BEHAVIOUR))
    parser.add_argument("--trickle-s", type=float, default=2.0)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    print(listener.getsockname()[1], flush=True)
    log_lock = threading.Lock()
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn, args.mode, args.trickle_s, args.log, log_lock), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
