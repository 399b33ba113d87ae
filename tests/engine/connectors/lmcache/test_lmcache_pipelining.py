"""lm:// GETs pipelined over the pool: a slow connection never holds up the rest of a wave.

The slow connection is real: tests/support/stalling_lm_proxy.py forwards to LMCache's own server and
holds back the requests of the first connection to send a GET, until the other connections have
forwarded all but GET_WINDOW of the wave's GETs. With items dealt out to fixed stripes the
other connections could never get there (a quarter of the wave waits behind the stalled one),
and the proxy would give up after its fallback; so the assertions count who carried what,
they never time anything.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtool.engine.connectors.lmcache.stores.lm_client import GET_WINDOW
from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.connectors.lmcache.stores.protocol import kv_chunk_header, tensor_buffer
from kvtool.engine.errors import KVRefused
from tests.support.port_process import port_process

SHAPE = (2, 2, 16, 64)
WAVE = 16


@contextlib.contextmanager
def stalling_proxy(tmp_path: Path, upstream_port: int, release_after: int,
                   hold: str = "first-get") -> Iterator[tuple[int, Path]]:
    """Start tests/support/stalling_lm_proxy.py in front of the server; yields (port, log); killed by PID."""
    log = tmp_path / "proxy.log"
    log.touch()
    with port_process("stalling_lm_proxy.py", str(upstream_port), "--release-after", str(release_after),
                      "--fallback-s", "20", "--log", str(log), "--hold", hold) as port:
        yield port, log


def chunks_on_server(server, n: int) -> tuple[list[str], list[torch.Tensor]]:
    keys = [f"kvtool-test/pipelining@1@0@{uuid.uuid4().int & (2**64 - 1):x}@bfloat16" for _ in range(n)]
    values = [torch.randint(-(2**15), 2**15, SHAPE, dtype=torch.int16, generator=torch.Generator().manual_seed(i))
              .view(torch.bfloat16) for i in range(n)]
    header = kv_chunk_header(SHAPE, torch.bfloat16)
    with LMClient(server.host, server.port, connections=2) as direct:
        assert direct.put_many([(k, tensor_buffer(v), header) for k, v in zip(keys, values)]) == [True] * n
    return keys, values


@pytest.mark.peer
def test_a_stalled_connection_holds_at_most_its_window(lmcache_server, tmp_path):
    keys, values = chunks_on_server(lmcache_server, WAVE)
    header = kv_chunk_header(SHAPE, torch.bfloat16)
    outs = [torch.empty(SHAPE, dtype=torch.bfloat16) for _ in keys]
    finished: list[int] = []
    with stalling_proxy(tmp_path, lmcache_server.port, release_after=WAVE - GET_WINDOW) as (port, log):
        with LMClient("127.0.0.1", port, connections=4, timeout_s=60.0) as client:
            results = client.get_many_into([(k, tensor_buffer(o), header) for k, o in zip(keys, outs)],
                                           on_result=lambda i, r: finished.append(i))
        lines = log.read_text().splitlines()
    assert results == [header] * WAVE
    assert sorted(finished) == list(range(WAVE))
    for value, out in zip(values, outs):
        assert torch.equal(value.view(torch.int16), out.view(torch.int16))
    # The other connections carried all but the stalled connection's window, before it moved.
    assert "released by timeout" not in lines, lines
    release = lines.index("released by count")
    slow = [i for i, line in enumerate(lines) if line == "GET slow"]
    others = [i for i, line in enumerate(lines) if line.startswith("GET ") and line != "GET slow"]
    assert 1 <= len(slow) <= GET_WINDOW and len(slow) + len(others) == WAVE
    assert all(i > release for i in slow)
    assert sum(i < release for i in others) >= WAVE - GET_WINDOW


@pytest.mark.peer
def test_gets_never_wait_behind_a_put_in_flight(lmcache_server, tmp_path):
    """Reads and writes have connections of their own: with one connection each, a GET wave
    reaches the server while a PUT is held back by the proxy, which lets the PUT go once the
    GETs passed ("released by count"). Sharing one connection, the GETs would wait for the PUT,
    and the PUT for the proxy's fallback ("released by timeout")."""
    import threading

    keys, values = chunks_on_server(lmcache_server, 2)
    header = kv_chunk_header(SHAPE, torch.bfloat16)
    outs = [torch.empty(SHAPE, dtype=torch.bfloat16) for _ in keys]
    new_key = f"kvtool-test/pipelining@1@0@{uuid.uuid4().int & (2**64 - 1):x}@bfloat16"
    stored: list[list[bool]] = []
    with stalling_proxy(tmp_path, lmcache_server.port, release_after=2, hold="puts") as (port, log):
        with LMClient("127.0.0.1", port, connections=1, timeout_s=60.0) as client:
            put = threading.Thread(target=lambda: stored.append(
                client.put_many([(new_key, tensor_buffer(values[1]), header)])))
            put.start()
            wait_for_line(log, "PUT held")
            results = client.get_many_into([(k, tensor_buffer(o), header) for k, o in zip(keys, outs)])
            put.join()
        lines = log.read_text().splitlines()
    assert results == [header] * 2 and all(torch.equal(v.view(torch.int16), o.view(torch.int16))
                                           for v, o in zip(values, outs))
    assert stored == [[True]]
    # Both GETs went to the server while the PUT was held; it was let go by their count.
    assert "released by count" in lines and "released by timeout" not in lines, lines
    assert lines.index("PUT held") < lines.index("released by count")


def wait_for_line(log: Path, line: str, limit_s: float = 30.0) -> None:
    """Until `line` is in the proxy's log (bounded, so a proxy that never logs it fails the test)."""
    import time

    end = time.monotonic() + limit_s
    while line not in log.read_text().splitlines():
        assert time.monotonic() < end, f"the proxy never logged {line!r}"
        time.sleep(0.02)


@pytest.mark.peer
def test_a_wave_through_the_connector_loads_past_a_stalled_connection(make_engine, lmcache_server, tmp_path):
    """The same through the engine: a 20-chunk full hit whose GETs pass the stalling proxy loads
    every chunk, with the stalled connection holding at most its window, and gives the cold
    run's tokens."""
    import json

    from kvtool.engine.connectors.config import parse_kv_transfer_config
    from kvtool.engine.params import SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    p = [(i * 37 + 11) % 240 + 5 for i in range(20 * 16)]
    ref = make_engine().generate([p], sp)[0]

    def ktc(port):
        return parse_kv_transfer_config(json.dumps({
            "kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
            # No payload digests: their GETs, a wave of their own before the chunks', would take the stall.
            "kv_connector_extra_config": {"host": "127.0.0.1", "port": port, "chunk_tokens": 16, "connections": 4,
                                          "timeout_s": 60.0, "verify_payload": False},
        }))

    writer = make_engine(kv_transfer_config=ktc(lmcache_server.port), enable_prefix_caching=False)
    writer.generate([p], sp)
    writer.executor.worker.connector.flush()
    with stalling_proxy(tmp_path, lmcache_server.port, release_after=20 - GET_WINDOW) as (port, log):
        reader = make_engine(kv_transfer_config=ktc(port), enable_prefix_caching=False)
        hit = reader.generate([p], sp)[0]
        lines = log.read_text().splitlines()
    assert hit.stats.num_external_loaded_tokens == 20 * 16 and hit.output_token_ids == ref.output_token_ids
    assert "released by timeout" not in lines and "released by count" in lines, lines
    assert 1 <= lines.count("GET slow") <= GET_WINDOW


@pytest.mark.peer
def test_a_refused_reply_fails_its_item_and_the_window_is_sent_again(lmcache_server):
    """One connection, GET_WINDOW in flight: a reply other than expected drops the connection
    with the next GET already sent on it; that GET goes again on a fresh connection."""
    keys, values = chunks_on_server(lmcache_server, 6)
    header = kv_chunk_header(SHAPE, torch.bfloat16)
    wrong = kv_chunk_header((2, 2, 8, 128), torch.bfloat16)  # same length, another shape
    outs = [torch.empty(SHAPE, dtype=torch.bfloat16) for _ in keys]
    items = [(k, tensor_buffer(o), wrong if i == 2 else header) for i, (k, o) in enumerate(zip(keys, outs))]
    with LMClient(lmcache_server.host, lmcache_server.port, connections=1) as client:
        results = client.get_many_into(items)
        assert client.health()
    assert isinstance(results[2], KVRefused)
    assert results[:2] + results[3:] == [header] * 5
    for i, (value, out) in enumerate(zip(values, outs)):
        if i != 2:
            assert torch.equal(value.view(torch.int16), out.view(torch.int16))


@pytest.mark.peer
def test_a_wave_on_sockets_of_a_restarted_server_reconnects(restartable_lmcache_server):
    """The pool's sockets died with the server: the wave's GETs are sent again on fresh
    connections and find the restarted (empty) server, instead of failing."""
    server = restartable_lmcache_server
    keys, _ = chunks_on_server(server, 5)
    header = kv_chunk_header(SHAPE, torch.bfloat16)
    outs = [torch.empty(SHAPE, dtype=torch.bfloat16) for _ in keys]
    with LMClient(server.host, server.port, connections=2) as client:
        assert client.get_many_into([(k, tensor_buffer(o), header) for k, o in zip(keys, outs)]) == [header] * 5
        assert client.num_open_connections() >= 1
        server.restart()
        assert client.get_many_into([(k, tensor_buffer(o), header) for k, o in zip(keys, outs)]) == [None] * 5
