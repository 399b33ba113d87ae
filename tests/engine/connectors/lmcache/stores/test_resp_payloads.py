"""Chunk payloads over the raw RESP connections (resp_wire.py, resp_pool.py), against real
redis-server processes started by the suite: large chunks byte-exact over one and four
connections, refusals that keep the connection, a server that trickles or drops a reply, AUTH
and SELECT, TLS, and a three-master cluster whose slots move under the store (-ASK, -MOVED).

The faulty servers are a real redis-server behind a TCP proxy in this file, which forwards every
byte until told to trickle (a few KiB at a time, slowly) or to cut a connection in the middle of
a reply.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import threading
import time

import pytest
import redis
import torch
from redis.crc import key_slot

from kvtool.engine.connectors.lmcache.stores.protocol import kv_chunk_header, tensor_buffer
from kvtool.engine.connectors.lmcache.stores.store import store_address
from kvtool.engine.connectors.lmcache.stores.store_factory import open_store
from kvtool.engine.errors import ConfigError, KVRefused, PeerError
from kvtool.workloads.redis_server import HOST, RedisServer, free_port

pytestmark = pytest.mark.slow

SHAPE = (2, 4, 256, 1027)  # float32: 8.4 MB, an odd hidden size
HEADER = kv_chunk_header(SHAPE, torch.float32)
PASSWORD = "Resp-s3cret-Pa55"


def chunks(prefix: str, n: int, shape=SHAPE, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = [f"{prefix}@1@0@{i:x}@float" for i in range(n)]
    return keys, [torch.randn(shape, generator=gen) for _ in keys]


def store(url: str, connections: int = 1, timeout_s: float = 10.0, header=HEADER):
    return open_store(store_address(url), connections=connections, timeout_s=timeout_s, chunk_header=header)


def put(st, keys, tensors, shape=SHAPE):
    header = kv_chunk_header(shape, torch.float32)
    return st.put_many([(k, tensor_buffer(t), header) for k, t in zip(keys, tensors)])


def get(st, keys, shape=SHAPE, expected=True):
    header = kv_chunk_header(shape, torch.float32)
    bufs = [torch.zeros(shape) for _ in keys]
    results = st.get_many_into([(k, tensor_buffer(b), header if expected else None) for k, b in zip(keys, bufs)])
    return results, bufs


def connections_received(port: int, db: redis.Redis | None = None) -> int:
    client = db or redis.Redis(host=HOST, port=port)
    return int(client.info("stats")["total_connections_received"])


class FaultyProxy:
    """A TCP proxy to a real server. Set `trickle` to forward at most 4 KiB per 50 ms each way;
    set `drops` to N to cut each of the next N connections once it forwarded `drop_after` bytes
    of replies (then it forwards whole again)."""

    def __init__(self, upstream_port: int, drop_after: int = 1 << 20) -> None:
        self.upstream_port, self.drop_after = upstream_port, drop_after
        self.trickle = threading.Event()
        self.drops = 0
        self.lock = threading.Lock()
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((HOST, self.upstream_port))
            with self.lock:
                self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        forwarded, cut = 0, False
        try:
            while data := src.recv(4096 if self.trickle.is_set() else 1 << 20):
                if self.trickle.is_set():
                    time.sleep(0.05)
                if replies and not cut and forwarded + len(data) > self.drop_after:
                    with self.lock:
                        cut = self.drops > 0
                        self.drops -= cut
                    if cut:
                        dst.sendall(data[: self.drop_after - forwarded])
                        break
                dst.sendall(data)
                forwarded += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        with self.lock:
            for s in self.sockets:
                s.close()


@pytest.fixture
def proxy(redis_server):
    p = FaultyProxy(redis_server.port)
    try:
        yield p
    finally:
        p.close()


# ---------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("connections", [1, 4])
@pytest.mark.parametrize("scheme", ["redis", "valkey"])
def test_large_chunks_round_trip_byte_exact(redis_server, scheme, connections):
    url = f"{scheme}://{HOST}:{redis_server.port}" + ("/6" if scheme == "redis" else "")
    keys, tensors = chunks(f"resp-big-{scheme}-{connections}", 6, seed=connections)
    with store(url, connections) as st:
        assert put(st, keys, tensors) == [True] * 6
        results, bufs = get(st, keys)
        assert results == [HEADER] * 6
        assert all(torch.equal(a, b) for a, b in zip(tensors, bufs))
        assert st.exist_many(keys) == [True] * 6
        # A miss among hits, and a buffer larger than the chunk (the chunk fills its head).
        bigger = torch.full((SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3] + 100,), 7.0)
        out = st.get_many_into([(keys[0] + "-absent", tensor_buffer(torch.zeros(SHAPE)), HEADER),
                                (keys[1], tensor_buffer(bigger), None)])
        assert out == [None, HEADER]
        assert torch.equal(bigger[: tensors[1].numel()], tensors[1].reshape(-1)) and bigger[-1] == 7.0


def test_partial_chunks_keep_their_shape_and_the_layout_is_lmcaches(redis_server):
    url = f"redis://{HOST}:{redis_server.port}"
    tail = (2, 4, 37, 1027)
    keys, tensors = chunks("resp-tail", 3, shape=tail)
    with store(url, 2) as st:
        assert put(st, keys, tensors, shape=tail) == [True] * 3
        results, bufs = get(st, keys, shape=tail)
        assert results == [kv_chunk_header(tail, torch.float32)] * 3
        assert all(torch.equal(a, b) for a, b in zip(tensors, bufs))
    db = redis.Redis(host=HOST, port=redis_server.port)
    length = 4 * torch.Size(tail).numel()
    assert db.get(keys[0] + "metadata") == struct.pack("=7i", length, 1, 4, *tail)
    assert db.get(keys[0] + "kv_bytes") == tensors[0].numpy().tobytes()


def test_unix_socket_round_trip(tmp_path):
    sock = tmp_path / "redis.sock"
    server = RedisServer(free_port(), tmp_path / "r", ["--unixsocket", str(sock), "--unixsocketperm", "700"]).start()
    try:
        keys, tensors = chunks("resp-unix", 3)
        with store(f"unix://{sock}?db=2", 2) as st:
            assert put(st, keys, tensors) == [True] * 3
            results, bufs = get(st, keys)
            assert results == [HEADER] * 3 and all(torch.equal(a, b) for a, b in zip(tensors, bufs))
        assert redis.Redis(unix_socket_path=str(sock), db=2).exists(keys[0] + "kv_bytes")
    finally:
        server.stop()


# ---------------------------------------------------------------------------------- refusals


def test_a_chunk_that_does_not_match_is_refused_and_the_connection_stays(redis_server):
    url = f"redis://{HOST}:{redis_server.port}"
    keys, tensors = chunks("resp-mismatch", 2)
    db = redis.Redis(host=HOST, port=redis_server.port)
    other = (2, 8, 256, 1027 // 2 + 1)  # a different shape
    wrong_len = keys[1] + "-short"
    with store(url, 1) as st:
        assert put(st, keys, tensors) == [True, True]
        # Metadata that announces the payload's size, over a payload 4 bytes short.
        db.set(wrong_len + "kv_bytes", tensors[1].numpy().tobytes()[:-4])
        db.set(wrong_len + "metadata", db.get(keys[1] + "metadata"))
        assert get(st, keys[:1])[0] == [HEADER]  # connected
        before = connections_received(redis_server.port, db)
        small = torch.zeros(1000)
        out = st.get_many_into([
            (keys[0], tensor_buffer(torch.zeros(SHAPE)), kv_chunk_header(other, torch.float32)),
            (keys[1], tensor_buffer(small), None),
            (wrong_len, tensor_buffer(torch.zeros(SHAPE)), HEADER),
            (keys[1], tensor_buffer(torch.zeros(SHAPE)), HEADER),
        ])
        assert isinstance(out[0], KVRefused) and "shape: expected" in str(out[0])
        assert isinstance(out[1], PeerError) and "the buffer holds 4000" in str(out[1])
        assert torch.count_nonzero(small) == 0  # refused before a payload byte was read
        assert isinstance(out[2], PeerError) and "payload is" in str(out[2])
        assert out[3] == HEADER
        results, bufs = get(st, keys)
        assert results == [HEADER, HEADER] and all(torch.equal(a, b) for a, b in zip(tensors, bufs))
        assert connections_received(redis_server.port, db) == before  # the same connection throughout


def test_an_evicted_payload_deletes_the_metadata_and_is_a_miss(redis_server):
    url = f"redis://{HOST}:{redis_server.port}"
    keys, tensors = chunks("resp-evicted", 2)
    db = redis.Redis(host=HOST, port=redis_server.port)
    with store(url, 1) as st:
        assert put(st, keys, tensors) == [True, True]
        db.delete(keys[0] + "kv_bytes")
        results, bufs = get(st, keys)
        assert results == [None, HEADER] and torch.equal(bufs[1], tensors[1])
        assert not db.exists(keys[0] + "metadata")


# ---------------------------------------------------------------------------------- faulty servers


@pytest.mark.parametrize("connections", [1, 4])
def test_a_trickling_server_costs_at_most_the_deadline(redis_server, proxy, connections):
    keys, tensors = chunks(f"resp-trickle-{connections}", 3)
    url = f"redis://{HOST}:{proxy.port}"
    timeout_s = 2.0
    with store(url, connections, timeout_s=timeout_s) as st:
        assert put(st, keys, tensors) == [True] * 3
        assert get(st, keys)[0] == [HEADER] * 3  # connected
        proxy.trickle.set()
        started = time.monotonic()
        results, _ = get(st, keys)
        elapsed = time.monotonic() - started
        assert all(isinstance(r, PeerError) and "timed out after 2 s" in str(r) for r in results), results
        started = time.monotonic()
        assert put(st, keys[:1], tensors[:1]) == [False]
        elapsed = max(elapsed, time.monotonic() - started)
        # One deadline, plus room for a loaded machine; never one deadline per chunk.
        assert elapsed < timeout_s + 3.0
        proxy.trickle.clear()
        results, bufs = get(st, keys)
        assert results == [HEADER] * 3 and all(torch.equal(a, b) for a, b in zip(tensors, bufs))


def test_a_server_that_drops_the_connection_mid_reply(redis_server, proxy):
    keys, tensors = chunks("resp-drop", 3)
    with store(f"redis://{HOST}:{proxy.port}", 1) as st:
        assert put(st, keys, tensors) == [True] * 3
        # Once: the GET is sent again on a fresh connection and succeeds.
        proxy.drops = 1
        results, bufs = get(st, keys)
        assert results == [HEADER] * 3 and all(torch.equal(a, b) for a, b in zip(tensors, bufs))
        # Every time for a while: the first chunk fails (its retry is cut too), alone.
        proxy.drops = 2
        results, bufs = get(st, keys)
        assert isinstance(results[0], PeerError) and "GET failed" in str(results[0])
        assert results[1:] == [HEADER, HEADER] and torch.equal(bufs[2], tensors[2])
        assert proxy.drops == 0
        results, bufs = get(st, keys)
        assert results == [HEADER] * 3 and all(torch.equal(a, b) for a, b in zip(tensors, bufs))


def test_a_server_gone_fails_each_item_and_a_restarted_one_serves(own_redis_server):
    keys, tensors = chunks("resp-gone", 2)
    with store(f"redis://{HOST}:{own_redis_server.port}", 2, timeout_s=5.0) as st:
        assert put(st, keys, tensors) == [True, True]
        own_redis_server.stop()
        results, _ = get(st, keys)
        assert all(isinstance(r, PeerError) and "GET failed" in str(r) for r in results), results
        own_redis_server.start()  # empty
        assert get(st, keys)[0] == [None, None]
        assert put(st, keys, tensors) == [True, True]
        assert get(st, keys)[0] == [HEADER, HEADER]


# ---------------------------------------------------------------------------------- credentials


@pytest.fixture
def password_server(tmp_path):
    server = RedisServer(free_port(), tmp_path / "auth", ["--requirepass", PASSWORD]).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("user", ["", "default"])
def test_auth_and_select(password_server, user):
    url = f"redis://{user}:{PASSWORD}@{HOST}:{password_server.port}/3"
    keys, tensors = chunks(f"resp-auth-{user}", 2)
    with store(url, 2) as st:
        assert put(st, keys, tensors) == [True, True]
        results, bufs = get(st, keys)
        assert results == [HEADER, HEADER] and all(torch.equal(a, b) for a, b in zip(tensors, bufs))
    db = redis.Redis(host=HOST, port=password_server.port, password=PASSWORD, db=3)
    assert db.exists(keys[0] + "kv_bytes", keys[0] + "metadata") == 2


@pytest.mark.parametrize("url", [f":not-the-{PASSWORD}@", ""])
def test_refused_credentials_are_a_config_error_per_item(password_server, url, caplog):
    keys, tensors = chunks("resp-noauth", 2)
    with store(f"redis://{url}{HOST}:{password_server.port}", 2) as st:
        results, _ = get(st, keys)
        assert all(isinstance(r, ConfigError) and "refused the credentials" in str(r) for r in results), results
        # A server cuts a client that sends a large value before AUTH: then no reply says why.
        assert put(st, keys, tensors) == [False, False]
    assert ("refused the credentials" in caplog.text) == bool(url)
    assert PASSWORD not in " ".join(str(r) for r in results) + caplog.text


def test_tls_with_auth(tmp_path):
    """rediss:// against redis-server's own TLS port (a certificate made for the test), with a password."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    tls_port = free_port()
    server = RedisServer(free_port(), tmp_path / "tls", [
        "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no", "--requirepass", PASSWORD]).start()
    try:
        keys, tensors = chunks("resp-tls", 3)
        with store(f"rediss://:{PASSWORD}@{HOST}:{tls_port}/1?ssl_ca_certs={cert}", 2) as st:
            assert put(st, keys, tensors) == [True] * 3
            results, bufs = get(st, keys)
            assert results == [HEADER] * 3 and all(torch.equal(a, b) for a, b in zip(tensors, bufs))
        # Without the CA the server's certificate is not trusted: every item fails, one line each.
        with store(f"rediss://:{PASSWORD}@{HOST}:{tls_port}/1", 1) as st:
            results, _ = get(st, keys[:1])
            assert isinstance(results[0], PeerError) and "CERTIFICATE_VERIFY_FAILED" in str(results[0])
    finally:
        server.stop()


# ---------------------------------------------------------------------------------- cluster


def owners(cluster, keys):
    nodes = redis.cluster.RedisCluster(host=HOST, port=cluster.nodes[0].port)
    try:
        return {nodes.get_node_from_key(k).port for k in keys}
    finally:
        nodes.close()


@pytest.mark.parametrize("connections", [1, 4])
def test_cluster_round_trip_over_every_master(redis_cluster, connections):
    keys, tensors = chunks(f"resp-cluster-{connections}", 8, seed=connections)
    assert len(owners(redis_cluster, [k + s for k in keys for s in ("kv_bytes", "metadata")])) == 3
    with store(redis_cluster.url, connections) as st:
        assert put(st, keys, tensors) == [True] * 8
        results, bufs = get(st, keys)
        assert results == [HEADER] * 8 and all(torch.equal(a, b) for a, b in zip(tensors, bufs))
        assert get(st, [keys[0] + "-absent"])[0] == [None]


def test_cluster_slot_moving_under_the_store(own_redis_cluster):
    """A slot in migration answers -ASK for the keys already moved; once moved, -MOVED."""
    cluster = own_redis_cluster
    # One hash tag: both keys of every chunk live in the one slot that moves.
    keys, tensors = chunks("resp-{moving}", 3)
    slot = key_slot(b"moving")
    nodes = {n.port: redis.Redis(host=HOST, port=n.port) for n in cluster.nodes}
    ids = {port: c.execute_command("CLUSTER", "MYID").decode() for port, c in nodes.items()}
    with store(cluster.url, 1) as writer, store(cluster.url, 2) as reader:
        assert put(writer, keys[:2], tensors[:2]) == [True, True]
        assert get(reader, keys[:2])[0] == [HEADER, HEADER]  # both hold the slot map now
        (src,) = owners(cluster, [keys[0] + "kv_bytes"])
        dst = next(p for p in nodes if p != src)
        nodes[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
        nodes[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
        moved = [k + s for k in keys[:1] for s in ("kv_bytes", "metadata")]
        nodes[src].execute_command("MIGRATE", HOST, dst, "", 0, 10000, "KEYS", *moved)
        # Migrating: keys[0] answers -ASK from the old owner, keys[1] is still there; a new key
        # goes to the new owner.
        results, bufs = get(reader, keys[:2])
        assert results == [HEADER, HEADER] and all(torch.equal(a, b) for a, b in zip(tensors, bufs))
        assert put(writer, keys[2:], tensors[2:]) == [True]
        assert nodes[dst].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 4
        rest = [k + s for k in keys[1:2] for s in ("kv_bytes", "metadata")]
        nodes[src].execute_command("MIGRATE", HOST, dst, "", 0, 10000, "KEYS", *rest)
        for c in nodes.values():
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
        # Moved: both stores' maps are stale; -MOVED reloads them.
        results, bufs = get(reader, keys)
        assert results == [HEADER] * 3 and all(torch.equal(a, b) for a, b in zip(tensors, bufs))
        assert put(writer, keys[:1], tensors[1:2]) == [True]
        results, bufs = get(reader, keys[:1])
        assert results == [HEADER] and torch.equal(bufs[0], tensors[1])
    assert nodes[dst].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 6
