"""Slow and hostile lm:// peers: every wait has a deadline, and no lookup stalls the engine loop.

The peer is tests/support/broken_lm_server.py, a real process that trickles one byte every 0.75 s
(faster than the 1 s timeout, so a per-read timeout never fires), goes silent, or lies. Each
test runs what could hang under a guard far above its deadlines (a hang guard, not a timing
assertion): a trickled 36-byte reply alone takes 27 s, so an operation without a deadline for
the whole of it runs into the guard.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import openai
import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.stores.lm_client import GET_WINDOW
from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.errors import PeerError
from kvtool.engine.params import SamplingParams
from tests.support.port_process import port_process
from tests.support.server_process import ServerProcess

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
GUARD_S = 20.0
T = TypeVar("T")


@contextlib.contextmanager
def broken_server(tmp_path: Path, mode: str, trickle_s: float = 0.75) -> Iterator[tuple[int, Path]]:
    """Start tests/support/broken_lm_server.py in `mode`; yields (port, request log); killed by PID."""
    log = tmp_path / f"{mode}-requests.log"
    log.touch()
    with port_process("broken_lm_server.py", mode, "--trickle-s", str(trickle_s), "--log", str(log)) as port:
        yield port, log


def requests_seen(log: Path, command: str) -> int:
    return log.read_text().split().count(command)


def lm_config(port: int, policy: str = "recompute", **extra: object):
    settings = {"host": "127.0.0.1", "port": port, "timeout_s": 1.0, "lookup_timeout_s": 0.5,
                "peer_backoff_s": 60.0, **extra}
    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "LMCacheConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy,
        "kv_connector_extra_config": settings,
    }))


def guarded(call: Callable[[], T]) -> T:
    """`call()` on a thread; fails the test if it has not returned within GUARD_S."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GUARD_S)
    assert not thread.is_alive(), f"still waiting after {GUARD_S} s: a wait without a deadline"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(i * 13 + seed * 101) % 240 + 5 for i in range(n)]


def test_client_deadline_covers_the_whole_operation(tmp_path):
    with broken_server(tmp_path, "trickle") as (port, log):
        client = LMClient("127.0.0.1", port, connections=1, timeout_s=1.0, backoff_s=60.0)
        assert not guarded(client.health)  # the reply would have been complete after 27 s
        with pytest.raises(PeerError, match="missed a deadline"):
            client.exists("m@1@0@1@half")  # fails fast: the server is backing off
        with pytest.raises(PeerError, match="missed a deadline"):
            client.get_into("m@1@0@1@half", bytearray(16))
        guarded(client.close)
        assert requests_seen(log, "HEALTH") == 1 and requests_seen(log, "EXIST") == 0


def test_each_trickled_operation_ends_at_its_deadline(tmp_path):
    with broken_server(tmp_path, "trickle") as (port, log):
        client = LMClient("127.0.0.1", port, connections=1, timeout_s=1.0, backoff_s=0)
        key = "m@1@0@1@half"
        for call in (
            lambda: client.exists(key),
            lambda: client.get_into(key, bytearray(16)),
            lambda: client.put(key, b"\0" * 16, 1, 4, (2, 1, 1, 2)),  # its confirming EXIST trickles
        ):
            with pytest.raises(PeerError, match="timed out"):
                guarded(call)
        guarded(client.close)
        assert [requests_seen(log, c) for c in ("EXIST", "GET", "PUT")] == [2, 1, 1]


@pytest.mark.parametrize("connections", [1, 2])
def test_a_large_payload_that_trickles_ends_at_its_deadline(tmp_path, connections):
    # Half of a 2 MiB payload at once, then a byte every 0.75 s: a read this large waits for a
    # piece of RCVLOWAT_BYTES (the socket's receive low-water mark), which must end at the deadline too.
    with broken_server(tmp_path, "trickle-payload") as (port, log):
        client = LMClient("127.0.0.1", port, connections=connections, timeout_s=1.0, backoff_s=0)
        buf = bytearray(2 * 1024 * 1024)
        for _ in range(2):
            with pytest.raises(PeerError, match="timed out"):
                guarded(lambda: client.get_into("m@1@0@1@half", buf))
        guarded(client.close)
        assert requests_seen(log, "GET") == 2


@pytest.mark.parametrize("mode", ["trickle-get", "lie"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_load_that_trickles_or_lies_ends_under_the_policy(make_engine, tmp_path, mode, policy):
    p = prompt(80)
    ref = make_engine().generate([p], GREEDY)[0]
    with broken_server(tmp_path, mode) as (port, _):
        engine = make_engine(kv_transfer_config=lm_config(port, policy))
        r = guarded(lambda: engine.generate([p], GREEDY)[0])
        guarded(engine.close)
    if policy == "fail":
        assert r.stats.num_external_tokens == 79  # the server claimed every chunk: a full hit
        assert r.finish_reason == "error" and r.output_token_ids == []
        # The payload digests' GETs go first: theirs time out, and the chunks' then fail at once.
        missed = "timed out" in r.error or "missed a deadline" in r.error
        assert missed == (mode == "trickle-get"), r.error
    else:
        assert r.output_token_ids == ref.output_token_ids


def test_trickled_health_and_lookups_bound_start_up_lookup_and_exit(make_engine, tmp_path):
    p = prompt(80)
    ref = make_engine().generate([p], GREEDY)[0]
    with broken_server(tmp_path, "trickle") as (port, _):
        with pytest.raises(PeerError, match="cannot reach the LMCache server"):
            guarded(lambda: make_engine(kv_transfer_config=lm_config(port, "fail")))
        # Without the back-off the trickled EXIST would be the lookup; with it, it fails at once.
        engine = guarded(lambda: make_engine(kv_transfer_config=lm_config(port, "recompute", peer_backoff_s=0)))
        r = guarded(lambda: engine.generate([p], GREEDY)[0])
        guarded(engine.close)
    assert r.stats.num_external_tokens == 0 and r.output_token_ids == ref.output_token_ids


def test_silent_server_costs_one_deadline_not_one_per_chunk(make_engine, tmp_path):
    p = prompt(67 * 16 + 1)  # 67 whole chunks of 16 tokens before the last token
    ref = make_engine().generate([p], GREEDY)[0]
    with broken_server(tmp_path, "silent-get") as (port, log):
        engine = make_engine(kv_transfer_config=lm_config(port, "recompute", connections=4))
        r = guarded(lambda: engine.generate([p], GREEDY)[0])
        guarded(engine.close)
        num_gets = requests_seen(log, "GET")
    assert r.output_token_ids == ref.output_token_ids
    # One window of GETs per connection ran into the deadline; every later chunk failed without asking.
    assert 1 <= num_gets <= 4 * GET_WINDOW


def test_serve_answers_other_requests_while_a_lookup_trickles(tiny_model_dir, tmp_path):
    with broken_server(tmp_path, "trickle-exist") as (port, log):
        ktc = {"kv_connector": "LMCacheConnector", "kv_role": "kv_consumer",
               "kv_connector_extra_config": {"host": "127.0.0.1", "port": port, "timeout_s": 8.0,
                                             "lookup_timeout_s": 8.0}}
        args = ["--model", str(tiny_model_dir), "--device", "cpu", "--kv-cache-memory", "64M",
                "--kv-transfer-config", json.dumps(ktc)]
        with ServerProcess(args) as srv:
            model = str(tiny_model_dir)
            client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=GUARD_S)
            a_result: dict[str, object] = {}

            def request_a() -> None:
                a_result["r"] = client.completions.create(model=model, prompt=prompt(64), max_tokens=2,
                                                          temperature=0.0)

            a = threading.Thread(target=request_a, daemon=True)
            a.start()
            for _ in range(400):  # until A's EXIST reached the server
                if requests_seen(log, "EXIST"):
                    break
                time.sleep(0.05)
            assert requests_seen(log, "EXIST") >= 1
            # B is shorter than one chunk: it needs no lookup and must not wait for A's.
            # Without a lookup thread B would wait for the trickled EXIST reply: 27 s.
            fast = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=15.0)
            b = fast.completions.create(model=model, prompt=prompt(5, seed=3), max_tokens=2, temperature=0.0)
            assert len(b.choices) == 1 and b.usage.completion_tokens == 2
            a.join(GUARD_S)
            assert not a.is_alive()
            assert a_result["r"].usage.prompt_tokens_details.cached_tokens == 0  # ran without the hit


@pytest.mark.parametrize(
    "tags, needle",
    [
        ({"lmcache.tag.user": "a@b"}, "contains '@'"),
        ({"lmcache.tag.user": "x" * 300}, "the limit is 150"),
        ({"lmcache.tag.a%b": "v"}, "contains '@' or '%'"),
        ({"lmcache.tag.user": "tab\there"}, "control characters"),
    ],
)
def test_tags_lmcache_keys_cannot_carry_are_bad_input(make_engine, lmcache_server, tags, needle):
    from kvtool.engine.errors import InputError

    ktc = parse_kv_transfer_config(json.dumps({
        "kv_connector": "LMCacheConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host": lmcache_server.host, "port": lmcache_server.port},
    }))
    engine = make_engine(kv_transfer_config=ktc)
    with pytest.raises(InputError, match=needle) as refused:
        engine.add_request(prompt(40), GREEDY, kv_transfer_params=tags)
    assert "\n" not in str(refused.value)
    assert not engine.has_unfinished_requests()
    engine.add_request(prompt(40), GREEDY, kv_transfer_params={"lmcache.tag.user": "alice"})
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert len(finished) == 1
