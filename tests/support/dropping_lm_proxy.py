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
import sys

from lm_proxy import GET, PUT, REQUEST, ForwardingProxy  # run as a script: its folder is on sys.path

GONE = b"kvtool-test@1@0@dropped@float32".ljust(150, b" ")


class DroppingProxy(ForwardingProxy):
    def __init__(self, upstream_port: int, drop_file: str, log_path: str) -> None:
        super().__init__(upstream_port, log_path)
        self.drop_file = drop_file
        self.was_dropped: set[bytes] = set()
        self.stored_again: set[bytes] = set()

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

    def before_send(self, index: int, state: dict, command: int, key: bytes, head: bytes) -> bytes:
        if command == PUT:
            with self.lock:
                if key in self.was_dropped:
                    self.stored_again.add(key)
            self.log(f"PUT {key.decode()}")
        elif command == GET and self.dropped(key):
            self.log(f"dropped {key.decode()}")
            return REQUEST.pack(*REQUEST.unpack(head)[:-1], GONE)
        return head


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("--drop-file", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    DroppingProxy(args.upstream_port, args.drop_file, args.log).serve_forever()


if __name__ == "__main__":
    sys.exit(main())
