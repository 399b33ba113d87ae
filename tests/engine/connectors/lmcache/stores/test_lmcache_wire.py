"""kvtool's lm:// client against LMCache's own server and LMCache's own client.

Everything talks to the real `lmcache.v1.server` from the peer environment, except the
malformed-reply tests: the real server never sends such replies, so a small scripted socket
server in this file plays that part. Only 127.0.0.1 and free ports are used.
"""

from __future__ import annotations

import signal
import socket
import struct
import threading
import tracemalloc
import uuid

import pytest
import torch

from kvtool.engine.connectors.lmcache.stores.connection import RCVLOWAT_BYTES
from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader, kv_chunk_header, tensor_buffer
from kvtool.engine.errors import KVRefused, PeerError
from tests.support.peer_server import finish_client, run_lmcache_client

peer = pytest.mark.peer  # needs the real LMCache server / client from scripts/peer-env
CHUNK_SHAPE = (2, 28, 16, 1024)  # Qwen3-0.6B KV_2LTD chunk of 16 tokens: 1,835,008 bytes of bf16
SMALL_SHAPE = (2, 2, 4, 8)  # docs 7.4


def unique_key(model: str = "kvtool-test/wire") -> str:
    """A key no other test uses: a random 64-bit chunk hash."""
    return f"{model}@1@0@{uuid.uuid4().int & (2**64 - 1):x}@bfloat16"


def small_object() -> torch.Tensor:
    """docs 7.4: value = 128·kv + 32·l + 8·t + j, exact in bf16. Shape [2, 2, 4, 8]."""
    kv = torch.arange(2).view(2, 1, 1, 1)
    layer = torch.arange(2).view(1, 2, 1, 1)
    tok = torch.arange(4).view(1, 1, 4, 1)
    j = torch.arange(8).view(1, 1, 1, 8)
    return (128 * kv + 32 * layer + 8 * tok + j).to(torch.bfloat16).contiguous()


def random_chunk(seed: int, shape: tuple[int, ...] = CHUNK_SHAPE) -> torch.Tensor:
    """A bf16 chunk of random bit patterns (NaNs included): compared bit for bit, never by value."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def put_tensor(client: LMClient, key: str, t: torch.Tensor) -> ChunkHeader:
    header = kv_chunk_header(t.shape, t.dtype)
    client.put(key, tensor_buffer(t), header.fmt, header.dtype_code, header.shape)
    return header


@pytest.fixture
def client(lmcache_server):
    host, port, _ = lmcache_server
    with LMClient(host, port, connections=4, timeout_s=10.0) as c:
        yield c


# -- the real server ------------------------------------------------------------------------------


@peer
def test_health(lmcache_server, client):
    host, port, pid = lmcache_server
    assert (host, port) == ("127.0.0.1", lmcache_server.port) and pid > 0
    assert client.health()


@peer
def test_small_object_round_trip_docs_7_4(lmcache_server, client):
    key, obj = unique_key(), small_object()
    assert not client.exists(key)
    header = put_tensor(client, key, obj)
    assert header == ChunkHeader(fmt=1, dtype_code=3, shape=SMALL_SHAPE, length=256)

    # put() returned only after a same-connection EXIST: any other connection sees it now.
    host, port, _ = lmcache_server
    with LMClient(host, port, connections=1) as other:
        assert other.exists(key)

    out = torch.full(SMALL_SHAPE, -1.0, dtype=torch.bfloat16)
    assert client.get_into(key, tensor_buffer(out), expected=header) == header
    assert same_bits(out, obj)
    assert out[1, 1, 0].tolist() == [160.0 + j for j in range(8)]  # V, layer 1, token 0


@peer
def test_chunk_round_trip_bit_exact(client):
    key, chunk = unique_key(), random_chunk(seed=7)
    header = put_tensor(client, key, chunk)
    assert header.length == 1_835_008
    out = torch.empty(CHUNK_SHAPE, dtype=torch.bfloat16)
    assert client.get_into(key, tensor_buffer(out), expected=header) == header
    assert same_bits(out, chunk)


@peer
def test_one_connection_reads_payloads_past_its_receive_low_water_mark(lmcache_server):
    """One connection reads payloads in pieces of at least RCVLOWAT_BYTES: a payload's last
    piece is shorter, and nothing follows the last payload, so the mark must come down for it
    (else the read would wait for bytes that never come, until the deadline)."""
    host, port, _ = lmcache_server
    sizes = (RCVLOWAT_BYTES + 300 * 1024, RCVLOWAT_BYTES // 3, 3 * RCVLOWAT_BYTES)
    chunks = [random_chunk(seed=20 + i, shape=(2, 4, n // 4096, 512)) for i, n in enumerate(sizes)]
    with LMClient(host, port, connections=1, timeout_s=30.0) as one:
        keys = [unique_key() for _ in chunks]
        headers = [put_tensor(one, k, c) for k, c in zip(keys, chunks)]
        outs = [torch.empty_like(c) for c in chunks]
        assert one.get_into(keys[0], tensor_buffer(outs[0]), expected=headers[0]) == headers[0]
        assert same_bits(outs[0], chunks[0])
        outs = [torch.empty_like(c) for c in chunks]
        items = [(k, tensor_buffer(o), h) for k, o, h in zip(keys, outs, headers)]
        assert one.get_many_into(items) == headers
        assert all(same_bits(o, c) for o, c in zip(outs, chunks))


@peer
def test_get_without_expectation_reports_what_is_stored(client):
    key, chunk = unique_key(), random_chunk(seed=8, shape=(2, 28, 5, 1024))  # a partial chunk
    put_tensor(client, key, chunk)
    out = torch.empty(CHUNK_SHAPE, dtype=torch.bfloat16)  # room for a full chunk
    header = client.get_into(key, tensor_buffer(out))
    assert header == ChunkHeader(1, 3, (2, 28, 5, 1024), chunk.nbytes)
    assert same_bits(out.view(-1)[: chunk.numel()].view(chunk.shape), chunk)


@peer
def test_reply_other_than_expected_is_refused(client):
    key, chunk = unique_key(), random_chunk(seed=9, shape=(2, 28, 5, 1024))
    put_tensor(client, key, chunk)
    out = torch.zeros(CHUNK_SHAPE, dtype=torch.bfloat16)
    with pytest.raises(KVRefused, match="shape"):
        client.get_into(key, tensor_buffer(out), expected=kv_chunk_header(CHUNK_SHAPE, torch.bfloat16))
    assert not out.any()  # refused before a single byte was copied
    assert client.health()  # the dropped connection is replaced on the next request


@peer
def test_miss_returns_none_and_leaves_the_buffer_alone(client):
    key = unique_key()
    out = torch.full(SMALL_SHAPE, 3.0, dtype=torch.bfloat16)
    assert client.get_into(key, tensor_buffer(out)) is None
    assert not client.exists(key)
    assert (out == 3.0).all()


@peer
def test_exist_many_is_pipelined_on_one_connection(lmcache_server, client):
    stored = [unique_key() for _ in range(3)]
    for key in stored:
        put_tensor(client, key, small_object())
    keys = [unique_key() for _ in range(600)]  # more than one pipelined batch
    for pos, key in zip((0, 299, 599), stored):
        keys[pos] = key
    host, port, _ = lmcache_server
    with LMClient(host, port, connections=4) as fresh:
        found = fresh.exist_many(keys)
        assert fresh.num_open_connections() == 1
    assert [i for i, hit in enumerate(found) if hit] == [0, 299, 599]
    assert client.exist_many([]) == []


@peer
def test_put_many_stripes_and_get_many_pipelines_over_four_connections(lmcache_server):
    host, port, _ = lmcache_server
    chunks = [random_chunk(seed=100 + i) for i in range(8)]
    keys = [unique_key() for _ in chunks]
    header = kv_chunk_header(CHUNK_SHAPE, torch.bfloat16)
    with LMClient(host, port, connections=4) as striped:
        assert striped.put_many([(k, tensor_buffer(c), header) for k, c in zip(keys, chunks)]) == [True] * 8
        assert striped.num_open_connections() == 4

    outs = [torch.empty(CHUNK_SHAPE, dtype=torch.bfloat16) for _ in range(9)]
    items = [(k, tensor_buffer(o), header) for k, o in zip(keys, outs)]
    items.insert(4, (unique_key(), tensor_buffer(outs[8]), header))  # one miss among the hits
    with LMClient(host, port, connections=4) as pipelined:
        results = pipelined.get_many_into(items)
        # Items go to whichever connection is free (test_lmcache_pipelining.py): at most all four.
        assert 1 <= pipelined.num_open_connections() <= 4
    assert results[4] is None
    assert results[:4] + results[5:] == [header] * 8
    for chunk, out in zip(chunks, outs):
        assert same_bits(out, chunk)


@peer
def test_bad_input_closes_the_connection_and_the_next_request_reconnects(client):
    with pytest.raises(PeerError, match="EXIST failed"):
        client.exists("not-a-cache-key")  # the server fails to parse it and hangs up
    assert client.health()


@peer
def test_reconnect_after_the_server_is_killed_and_restarted(restartable_lmcache_server):
    server = restartable_lmcache_server
    host, port, old_pid = server
    key = unique_key()
    with LMClient(host, port, connections=1) as a, LMClient(host, port, connections=1) as b:
        put_tensor(a, key, small_object())
        assert b.exists(key)  # both now hold an open socket

        server.stop(signal.SIGKILL)
        assert not a.health()
        with pytest.raises(PeerError, match="EXIST failed"):
            a.exists(key)

        server.launch()
        assert server.pid != old_pid
        # b's socket died with the old server: the request reconnects transparently, and
        # finds a server that restarted empty.
        assert b.exists(key) is False
        assert a.exists(key) is False  # a dropped its socket when the request failed
        put_tensor(a, key, small_object())
        assert b.exists(key)


# -- interop with LMCache's own client -------------------------------------------------------------


@peer
def test_interop_both_ways_with_lmcache_client(lmcache_server, client, tmp_path):
    host, port, _ = lmcache_server
    ours, theirs = random_chunk(seed=21), random_chunk(seed=22)
    our_key, their_key = unique_key("Qwen/Qwen3-0.6B"), unique_key("Qwen/Qwen3-0.6B")
    header = put_tensor(client, our_key, ours)

    their_file, fetched_file = tmp_path / "theirs.bin", tmp_path / "fetched.bin"
    their_file.write_bytes(tensor_buffer(theirs))
    # Both LMCache processes at once: each pays several seconds of imports.
    shape_arg = ",".join(map(str, CHUNK_SHAPE))
    putter = run_lmcache_client("put", host, str(port), their_key, shape_arg, "bfloat16", str(their_file))
    getter = run_lmcache_client("get", host, str(port), our_key, str(fetched_file))
    assert finish_client(putter) == {"stored": True}
    got = finish_client(getter)

    # LMCache's client decoded our chunk: same header, same bytes.
    assert got == {
        "hit": True,
        "shape": list(CHUNK_SHAPE),
        "dtype": "bfloat16",
        "fmt": "KV_2LTD",
        "fmt_code": 1,
        "length": header.length,
    }
    fetched = torch.frombuffer(bytearray(fetched_file.read_bytes()), dtype=torch.bfloat16).view(CHUNK_SHAPE)
    assert same_bits(fetched, ours)

    # Ours finds, fetches and decodes what LMCache's client stored.
    assert client.exists(their_key)
    out = torch.empty(CHUNK_SHAPE, dtype=torch.bfloat16)
    assert client.get_into(their_key, tensor_buffer(out), expected=header) == header
    assert same_bits(out, theirs)


# -- malformed replies (a scripted server: the real one never sends these) -------------------------


class ScriptedServer:
    """Answers each 186-byte request on 127.0.0.1 with the next scripted reply, then waits.

    A reply of None closes the connection instead. Counts connections, so tests can see that
    the client dropped a connection after a bad reply.
    """

    def __init__(self, replies: list[bytes | None]):
        self.replies = list(replies)
        self.num_connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.num_connections += 1
            self.conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            while self.replies:
                if len(conn.recv(186, socket.MSG_WAITALL)) < 186:
                    return
                reply = self.replies.pop(0)
                if reply is None:
                    conn.close()
                    return
                conn.sendall(reply)
        except OSError:
            return

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


def reply(code: int, length: int, fmt: int = 1, dtype: int = 3, dims=(0, 0, 0, 0)) -> bytes:
    return struct.pack("<9i", code, length, fmt, dtype, *dims, 0)


HEALTHY = reply(200, 0, 1, 2)


@pytest.mark.parametrize(
    ("bad_reply", "message"),
    [
        (reply(200, -5, dims=(2, 2, 4, 8)), "negative length"),
        (reply(200, 2**31 - 1, fmt=4, dtype=0, dims=(2**31 - 1, 0, 0, 0)), "buffer holds 256"),
        (reply(200, 29_360_128, dims=(2, 28, 256, 1024)), "buffer holds 256"),
        (reply(200, 1000, dims=(2, 2, 4, 8)), "disagrees with shape"),
        (reply(302, 0), "neither 200 nor 400"),
        (reply(200, 256, fmt=77, dims=(2, 2, 4, 8)), "unknown memory format"),
    ],
    ids=["negative", "2GiB", "full-chunk-into-256B", "inconsistent", "bad-code", "bad-fmt"],
)
def test_impossible_get_reply_is_refused_without_allocating(bad_reply, message):
    server = ScriptedServer([bad_reply, HEALTHY])
    buf = bytearray(256)
    try:
        with LMClient("127.0.0.1", server.port, connections=1, timeout_s=5.0) as c:
            tracemalloc.start()
            try:
                with pytest.raises(PeerError, match=message):
                    c.get_into(unique_key(), memoryview(buf))
                _, peak_bytes = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak_bytes < 4 << 20  # nothing sized by the announced length (29 MB, 2 GB)
            assert buf == bytearray(256)
            assert c.health()  # on a new connection: the old stream was abandoned
            assert server.num_connections == 2
    finally:
        server.close()


def test_malformed_exist_reply_is_an_error():
    server = ScriptedServer([reply(200, 4096, 1, 2)])
    try:
        with LMClient("127.0.0.1", server.port, connections=1, timeout_s=5.0) as c:
            with pytest.raises(PeerError, match="announces 4096"):
                c.exists(unique_key())
    finally:
        server.close()


def test_reply_cut_short_is_an_error_not_a_hang():
    server = ScriptedServer([None])
    try:
        with LMClient("127.0.0.1", server.port, connections=1, timeout_s=5.0) as c:
            with pytest.raises(PeerError, match="GET failed"):
                c.get_into(unique_key(), memoryview(bytearray(256)))
    finally:
        server.close()


def test_silent_server_times_out():
    server = ScriptedServer([])  # reads nothing, answers nothing
    try:
        with LMClient("127.0.0.1", server.port, connections=1, timeout_s=0.3) as c:
            with pytest.raises(PeerError, match="timed out"):
                c.exists(unique_key())
    finally:
        server.close()
