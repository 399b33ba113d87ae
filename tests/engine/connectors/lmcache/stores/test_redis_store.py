"""LMCacheConnector on real Redis stores: redis://, unix://, redis-cluster:// and valkey://.

Every server is a real `redis-server` started by the suite on loopback (tests/integration/conftest.py).
Debian bookworm packages no valkey-server, so the valkey:// layout runs against redis-server,
which speaks the same protocol. The slow store is a real redis-server behind a small TCP proxy
in this file that holds bytes back when told to.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import threading
import time

import pytest
import redis
import torch

from kvtool.engine.connectors.lmcache.keys import LMCacheKeySettings, make_chunk_keys
from kvtool.engine.errors import PeerError
from kvtool.workloads.redis_server import HOST
from tests.conftest import kvtool_cmd
from tests.support.redis_chunks import GREEDY, MODEL_NAME, chunk_keys, fill, prompt, store_config

def plain_client(server) -> redis.Redis:
    return redis.Redis(host=HOST, port=server.port)


def urls(request, kind):
    if kind == "cluster":
        return request.getfixturevalue("redis_cluster").url
    server = request.getfixturevalue("redis_server")
    return f"{kind}://{HOST}:{server.port}" + ("/3" if kind == "redis" else "")


@pytest.mark.parametrize("kind", ["redis", "valkey", "cluster"])
def test_fill_then_a_new_engine_loads_every_full_chunk(kind, make_engine, request):
    url = urls(request, kind)
    prompts = [prompt(600, 11), prompt(300, 12)]
    ref = make_engine().generate(prompts, GREEDY)
    # Stores are asynchronous: a request's output may be out before its chunks are confirmed, so
    # what was stored is proven by what a new engine loads, after the writer's flush.
    filled = fill(make_engine, url, prompts)
    reader = make_engine(kv_transfer_config=store_config(url))
    again = reader.generate(prompts, GREEDY)
    assert [r.stats.num_external_tokens for r in again] == [512, 256]
    assert [r.stats.num_external_loaded_tokens for r in again] == [512, 256]
    expected = [r.output_token_ids for r in ref]
    assert [r.output_token_ids for r in filled] == [r.output_token_ids for r in again] == expected


def test_redis_layout_is_lmcaches_two_keys(make_engine, redis_server):
    url = f"redis://{HOST}:{redis_server.port}/4"
    p = prompt(300, 13)
    fill(make_engine, url, [p])
    engine = make_engine()
    g = engine.executor.worker.kv_pages.geometry
    (key,) = chunk_keys(p)
    db = redis.Redis(host=HOST, port=redis_server.port, db=4)
    meta, payload = db.get(key + "metadata"), db.get(key + "kv_bytes")
    shape = (2, g.num_layers, 256, g.num_kv_heads * g.head_dim)
    # RemoteMetadata: native int32 [length, fmt KV_2LTD = 1, dtype code float32 = 4, shape x4].
    assert meta == struct.pack("=7i", len(payload), 1, 4, *shape)
    assert len(payload) == 4 * torch.Size(shape).numel()
    assert db.get(key) is None and db.ttl(key + "kv_bytes") == -1  # no bare key, no TTL


def test_valkey_layout_is_one_bare_key_with_the_ttl(make_engine, redis_server):
    url = f"valkey://{HOST}:{redis_server.port}"
    p = prompt(300, 14)
    fill(make_engine, url, [p], valkey_enable_ttl=True, valkey_ttl_sec=600)
    (key,) = chunk_keys(p)
    db = plain_client(redis_server)
    g = make_engine().executor.worker.kv_pages.geometry
    assert len(db.get(key)) == 4 * 2 * g.num_layers * 256 * g.num_kv_heads * g.head_dim
    assert db.get(key + "metadata") is None and db.get(key + "kv_bytes") is None
    assert 0 < db.ttl(key) <= 600


def test_unix_socket(make_engine, tmp_path):
    from kvtool.workloads.redis_server import RedisServer, free_port

    sock = tmp_path / "redis.sock"
    server = RedisServer(free_port(), tmp_path / "r", ["--unixsocket", str(sock), "--unixsocketperm", "700"]).start()
    try:
        url = f"unix://{sock}?db=1"
        p = prompt(300, 15)
        ref = make_engine().generate([p], GREEDY)[0]
        fill(make_engine, url, [p])
        r = make_engine(kv_transfer_config=store_config(url)).generate([p], GREEDY)[0]
        assert r.stats.num_external_loaded_tokens == 256 and r.output_token_ids == ref.output_token_ids
    finally:
        server.stop()


def test_missing_payload_deletes_the_metadata_and_is_a_miss(make_engine, redis_server):
    url = f"redis://{HOST}:{redis_server.port}"
    p = prompt(300, 16)
    ref = make_engine().generate([p], GREEDY)[0]
    fill(make_engine, url, [p])
    (key,) = chunk_keys(p)
    db = plain_client(redis_server)
    db.delete(key + "kv_bytes")  # as an eviction would
    r = make_engine(kv_transfer_config=store_config(url, policy="recompute")).generate([p], GREEDY)[0]
    assert r.output_token_ids == ref.output_token_ids and r.stats.num_external_loaded_tokens == 0
    # The orphan metadata was deleted by the load, and the recompute stored the chunk again.
    assert db.exists(key + "metadata") and db.exists(key + "kv_bytes")


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_redis_restarted_empty_between_lookup_and_load(make_engine, own_redis_server, policy):
    url = f"redis://{HOST}:{own_redis_server.port}"
    p = prompt(600, 17)
    ref = make_engine().generate([p], GREEDY)[0]
    fill(make_engine, url, [p])
    engine = make_engine(kv_transfer_config=store_config(url, policy=policy))
    worker = engine.executor.worker.connector
    original = worker.start_load_kv

    def restart_then_load():
        if worker._meta.loads:
            own_redis_server.restart_empty()
        original()

    worker.start_load_kv = restart_then_load
    r = engine.generate([p], GREEDY)[0]
    if policy == "fail":
        assert r.finish_reason == "error" and r.output_token_ids == []
        assert "no longer in redis://" in r.error
    else:
        assert r.output_token_ids == ref.output_token_ids


def _put_wrong_chunk(db, key, shape, fmt=1, dtype_code=4):
    payload = torch.ones(shape, dtype=torch.float32).numpy().tobytes()
    db.set(key + "kv_bytes", payload)
    db.set(key + "metadata", struct.pack("=7i", len(payload), fmt, dtype_code, *shape))


@pytest.mark.parametrize("variant", ["bigger", "same_size_other_shape", "valkey_wrong_size"])
def test_wrong_shape_under_the_right_key_is_refused(make_engine, redis_server, variant):
    seed = {"bigger": 18, "same_size_other_shape": 19, "valkey_wrong_size": 20}[variant]
    p = prompt(300, seed)
    ref = make_engine().generate([p], GREEDY)[0]
    scheme = "valkey" if variant == "valkey_wrong_size" else "redis"
    url = f"{scheme}://{HOST}:{redis_server.port}"
    engine = make_engine(kv_transfer_config=store_config(url, policy="fail"))
    g = engine.executor.worker.kv_pages.geometry
    (key,) = chunk_keys(p)
    db = plain_client(redis_server)
    hidden = g.num_kv_heads * g.head_dim
    if variant == "bigger":
        _put_wrong_chunk(db, key, (2, g.num_layers + 1, 256, hidden))
    elif variant == "same_size_other_shape":
        _put_wrong_chunk(db, key, (2, g.num_layers * 2, 256, hidden // 2))
    else:
        db.set(key, b"\x01" * (4 * 2 * g.num_layers * 255 * hidden))  # one token short of a chunk
    r = engine.generate([p], GREEDY)[0]
    assert r.finish_reason == "error" and r.output_token_ids == []
    if variant == "bigger":
        assert "announces" in r.error and "the buffer holds" in r.error  # refused before the payload is read
    elif variant == "same_size_other_shape":
        assert "does not fit this rank's KV pages" in r.error
        assert f"layers {g.num_layers * 2}, expected {g.num_layers}" in r.error
        assert f"KV hidden size {g.kv_hidden_size // 2}, expected {g.kv_hidden_size}" in r.error
    else:
        assert "no longer in valkey://" in r.error  # LMCache's rule: a value of the wrong size is a miss
    # Never scattered: a recomputing engine over the same store gives the reference output.
    rec = make_engine(kv_transfer_config=store_config(url, policy="recompute"))
    assert rec.generate([p], GREEDY)[0].output_token_ids == ref.output_token_ids


def test_more_chunks_than_load_buffers(make_engine, redis_server):
    """37 chunks of 16 tokens through a ring of 16 host buffers over 2 connections."""
    url = f"redis://{HOST}:{redis_server.port}"
    p = prompt(600, 21)
    ref = make_engine().generate([p], GREEDY)[0]
    fill(make_engine, url, [p], chunk_tokens=16, connections=2)
    r = make_engine(kv_transfer_config=store_config(url, chunk_tokens=16, connections=2)).generate([p], GREEDY)[0]
    assert r.stats.num_external_loaded_tokens == 592 and r.output_token_ids == ref.output_token_ids


# ---------------------------------------------------------------------------------- cluster faults


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_cluster_master_killed_mid_run(make_engine, own_redis_cluster, policy):
    cluster = own_redis_cluster
    prompts = [prompt(300, 30 + i) for i in range(6)]
    ref = make_engine().generate(prompts, GREEDY)
    fill(make_engine, cluster.url, prompts)
    nodes = redis.cluster.RedisCluster(host=HOST, port=cluster.nodes[0].port)
    try:
        def owner(key):
            return nodes.get_node_from_key(key).port
        victim_port = owner(chunk_keys(prompts[0])[0] + "kv_bytes")
        affected = [any(owner(k + s) == victim_port for k in chunk_keys(p) for s in ("kv_bytes", "metadata"))
                    for p in prompts]
    finally:
        nodes.close()
    assert any(affected) and not all(affected), affected  # the prompts were chosen so
    victim = next(n for n in cluster.nodes if n.port == victim_port)
    engine = make_engine(kv_transfer_config=store_config(cluster.url, policy=policy, timeout_s=5.0))
    worker = engine.executor.worker.connector
    original = worker.start_load_kv

    def kill_then_load():
        if worker._meta.loads and victim.proc is not None:
            assert len(worker._meta.loads) == len(prompts)  # every lookup ran before the kill
            victim.stop(signal.SIGKILL)
        original()

    worker.start_load_kv = kill_then_load
    # Lookups run on the scheduler half's own thread: let every one of them answer first, so the
    # kill falls between all lookups and all loads.
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    half = engine.scheduler.connector
    deadline = time.monotonic() + 30
    while any(half.get_num_new_matched_tokens(engine.scheduler.requests[i], 0)[0] is None for i in ids):
        assert time.monotonic() < deadline, "lookups did not answer"
        time.sleep(0.01)
    while engine.has_unfinished_requests():
        engine.step()
    out = [engine.pop_result(i) for i in ids]
    for r, hit, expected in zip(out, affected, ref):
        if policy == "recompute" or not hit:
            assert r.finish_reason == "length" and r.output_token_ids == expected.output_token_ids, (affected, [x.error for x in out])
        else:
            assert r.finish_reason == "error" and r.output_token_ids == [] and "redis-cluster://" in r.error
        if not hit:
            assert r.stats.num_external_loaded_tokens == 256


# ---------------------------------------------------------------------------------- slow store


class DelayingProxy:
    """A TCP proxy to a real server that, once `slow` is set, holds each piece back `delay_s`."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port, self.delay_s = upstream_port, delay_s
        self.slow = threading.Event()
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((HOST, self.upstream_port))
            self.sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.slow.is_set():
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.closed.set()
        for s in [self.listener, *self.sockets]:
            try:
                s.close()
            except OSError:
                pass


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_slow_store_times_out_under_the_policy(make_engine, redis_server, policy):
    p = prompt(300, 40 + (policy == "fail"))
    ref = make_engine().generate([p], GREEDY)[0]
    fill(make_engine, f"redis://{HOST}:{redis_server.port}", [p])
    # The deadline is far above a PING's time on a busy machine, the delay far above the deadline.
    proxy = DelayingProxy(redis_server.port, delay_s=8.0)
    try:
        engine = make_engine(kv_transfer_config=store_config(f"redis://{HOST}:{proxy.port}", policy=policy,
                                                             timeout_s=2.0))
        worker = engine.executor.worker.connector
        original = worker.start_load_kv

        def slow_then_load():
            if worker._meta.loads:
                proxy.slow.set()  # the lookup found the chunk; the store now answers too slowly
            original()

        worker.start_load_kv = slow_then_load
        r = engine.generate([p], GREEDY)[0]
        if policy == "fail":
            assert r.finish_reason == "error" and "timed out after 2 s" in r.error
        else:
            assert r.output_token_ids == ref.output_token_ids
        engine.close()  # bounded too: the stores' waits all have deadlines
    finally:
        proxy.close()


def test_slow_lookup_computes_instead(make_engine, redis_server):
    p = prompt(300, 42)
    ref = make_engine().generate([p], GREEDY)[0]
    fill(make_engine, f"redis://{HOST}:{redis_server.port}", [p])
    proxy = DelayingProxy(redis_server.port, delay_s=8.0)
    try:
        engine = make_engine(kv_transfer_config=store_config(f"redis://{HOST}:{proxy.port}", timeout_s=2.0))
        proxy.slow.set()
        r = engine.generate([p], GREEDY)[0]
        assert r.output_token_ids == ref.output_token_ids and r.stats.num_external_tokens == 0
    finally:
        proxy.close()


# ---------------------------------------------------------------------------------- credentials


@pytest.fixture
def password_server(tmp_path):
    from kvtool.workloads.redis_server import RedisServer, free_port

    server = RedisServer(free_port(), tmp_path / "auth", ["--requirepass", "s3cret-Pa55"]).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("where", ["url", "env"])
def test_wrong_password_is_one_line_at_start_up_exit_2(password_server, tiny_model_dir, cli_env, tmp_path, where):
    wrong = "not-the-Pa55word"
    url = f"redis://:{wrong}@{HOST}:{password_server.port}" if where == "url" else f"redis://{HOST}:{password_server.port}"
    env = {**cli_env, "KVTOOL_REDIS_PASSWORD": wrong} if where == "env" else cli_env
    ktc = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"remote_url": url}})
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt_token_ids": prompt(40, 1)}) + "\n")
    out = subprocess.run(kvtool_cmd() + ["generate", "--model", str(tiny_model_dir), "--prompt-file", str(f), "--json",
                                         "--max-tokens", "2", "--device", "cpu", "--kv-cache-memory", "64M",
                                         "--kv-transfer-config", ktc],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused the credentials" in lines[0], out.stderr
    assert wrong not in out.stderr and "Traceback" not in out.stderr


def test_password_from_the_environment(make_engine, password_server, monkeypatch):
    monkeypatch.setenv("KVTOOL_REDIS_PASSWORD", "s3cret-Pa55")
    url = f"redis://{HOST}:{password_server.port}"
    p = prompt(300, 43)
    fill(make_engine, url, [p])
    r = make_engine(kv_transfer_config=store_config(url)).generate([p], GREEDY)[0]
    assert r.stats.num_external_loaded_tokens == 256


def test_wrong_password_stops_serve_at_start_up(password_server, tiny_model_dir, cli_env):
    wrong = "not-the-Pa55word"
    ktc = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"remote_url": f"redis://:{wrong}@{HOST}:{password_server.port}"}})
    out = subprocess.run(kvtool_cmd() + ["serve", "--port", "0", "--model", str(tiny_model_dir), "--device", "cpu",
                                         "--kv-cache-memory", "64M", "--kv-transfer-config", ktc],
                         env=cli_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "refused the credentials" in out.stderr and wrong not in out.stderr + out.stdout
    assert "Traceback" not in out.stderr


def test_tls(make_engine, tmp_path):
    """rediss:// against redis-server's own TLS port, with a certificate made for the test."""
    from kvtool.workloads.redis_server import RedisServer, free_port

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    tls_port = free_port()
    server = RedisServer(free_port(), tmp_path / "tls", [
        "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]).start()
    try:
        url = f"rediss://{HOST}:{tls_port}?ssl_ca_certs={cert}"
        p = prompt(300, 44)
        ref = make_engine().generate([p], GREEDY)[0]
        fill(make_engine, url, [p])
        r = make_engine(kv_transfer_config=store_config(url)).generate([p], GREEDY)[0]
        assert r.stats.num_external_loaded_tokens == 256 and r.output_token_ids == ref.output_token_ids
        # Without the CA the server's certificate is not trusted: no store, under the policy.
        with pytest.raises(PeerError, match="cannot reach the remote store at rediss://"):
            make_engine(kv_transfer_config=store_config(f"rediss://{HOST}:{tls_port}"))
    finally:
        server.stop()


@pytest.mark.parametrize("url", ["redis", "redis-cluster", "valkey"])
def test_store_not_running_at_start(make_engine, url):
    from kvtool.workloads.redis_server import free_port

    url = f"{url}://{HOST}:{free_port()}"
    with pytest.raises(PeerError, match=f"cannot reach the remote store at {url}"):
        make_engine(kv_transfer_config=store_config(url))
    p = prompt(300, 45)
    r = make_engine(kv_transfer_config=store_config(url, policy="recompute")).generate([p], GREEDY)[0]
    assert r.finish_reason == "length" and r.stats.num_external_tokens == 0
    assert r.output_token_ids == make_engine().generate([p], GREEDY)[0].output_token_ids


def test_a_partial_chunk_keeps_its_own_shape(make_engine, redis_server):
    url = f"redis://{HOST}:{redis_server.port}/5"
    p = prompt(300, 46)
    fill(make_engine, url, [p], save_unfull_chunk=True)
    g = make_engine().executor.worker.kv_pages.geometry
    hidden = g.num_kv_heads * g.head_dim
    keys = [c.key for c in make_chunk_keys(p, LMCacheKeySettings(model_name=MODEL_NAME, kv_dtype="float",
                                                                  chunk_tokens=256, save_unfull_chunk=True))]
    assert len(keys) == 2
    db = redis.Redis(host=HOST, port=redis_server.port, db=5)
    tail = (2, g.num_layers, 300 - 256, hidden)
    assert db.get(keys[1] + "metadata") == struct.pack("=7i", 4 * torch.Size(tail).numel(), 1, 4, *tail)
    assert len(db.get(keys[1] + "kv_bytes")) == 4 * torch.Size(tail).numel()
