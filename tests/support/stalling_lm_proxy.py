"""An lm:// proxy for tests that stalls one connection, run as its own process.

    python tests/support/stalling_lm_proxy.py UPSTREAM_PORT --release-after N --fallback-s S --log FILE
        [--hold first-get|puts]

It forwards every connection to a real LMCache server on 127.0.0.1:UPSTREAM_PORT, byte for
byte, and reads the client's requests (186-byte headers, a PUT's payload after its header) to
see which are GETs. The first connection to send a GET is the slow one: from that GET on, its
requests are held back until the other connections together have forwarded N GETs (logged
`released by count`), or, so that a client that never gets there cannot hang, until S seconds
have passed (logged `released by timeout`). Every forwarded GET is logged as `GET slow` or
`GET <connection number>`. With `--hold puts` every PUT is held back instead (logged `PUT held`
as it arrives), until N GETs have been forwarded or S seconds have passed; GETs are logged as
`GET <connection number>`. The first stdout line is the port.
"""

from __future__ import annotations

import argparse
import sys
import threading

from lm_proxy import GET, PUT, ForwardingProxy  # run as a script: its folder is on sys.path


class StallingProxy(ForwardingProxy):
    def __init__(self, upstream_port: int, release_after: int, fallback_s: float, log_path: str,
                 hold_puts: bool = False) -> None:
        super().__init__(upstream_port, log_path)
        self.hold_puts = hold_puts
        self.release_after = release_after
        self.fallback_s = fallback_s
        self.released = threading.Event()
        self.other_gets = 0
        self.slow: int | None = None  # the connection that sent the first GET

    def is_slow(self, index: int) -> bool:
        """Whether connection `index` is the slow one (the first to ask, at its first GET)."""
        with self.lock:
            if self.slow is None:
                self.slow = index
            return self.slow == index

    def before_send(self, index: int, state: dict, command: int, key: bytes, head: bytes) -> bytes:
        if self.hold_puts:
            state["slow"] = False
            if command == PUT:
                self.log("PUT held")
                self.hold()
            return head
        if command == GET and "slow" not in state:
            # This connection's first GET: the slow one holds it back.
            state["slow"] = self.is_slow(index)
            if state["slow"]:
                self.hold()
        return head

    def after_send(self, index: int, state: dict, command: int, key: bytes) -> None:
        if command != GET:
            return
        slow = state["slow"]
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("--release-after", type=int, required=True)
    parser.add_argument("--fallback-s", type=float, default=30.0)
    parser.add_argument("--log", required=True)
    parser.add_argument("--hold", choices=("first-get", "puts"), default="first-get")
    args = parser.parse_args()
    StallingProxy(args.upstream_port, args.release_after, args.fallback_s, args.log,
                  hold_puts=args.hold == "puts").serve_forever()


if __name__ == "__main__":
    sys.exit(main())
