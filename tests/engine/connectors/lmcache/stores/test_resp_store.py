"""resp://, LMCache's native RESP connector layout (resp_store.py), against real redis-server
processes started by the suite: the bytes on the server read back with plain redis-py, round
trips over one and four connections, a value of the wrong size refused, a missing key a miss,
AUTH, the URL forms, and chunks shared both ways with LMCache 0.5.6's own `RESPConnector`
(its C++ client `lmcache.lmcache_redis`) in the peer environment.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import redis
import torch

from kvtool.engine.connectors.lmcache.stores.protocol import kv_chunk_header, tensor_buffer
from kvtool.engine.connectors.lmcache.stores.resp_store import RespChunkStore
from kvtool.engine.connectors.lmcache.stores.store import parse_store_url, store_address
from kvtool.engine.connectors.lmcache.stores.store_factory import open_store
from kvtool.engine.errors import ConfigError, KVRefused
from kvtool.peer.env import peer_env, peer_script
from kvtool.workloads.redis_server import HOST, RedisServer, free_port
from tests.support.peer_server import require_peer_python
from tests.support.redis_chunks import GREEDY, chunk_keys, fill, prompt, store_config

SHAPE = (2, 4, 256, 520)  # float32: 4.3 MB
HEADER = kv_chunk_header(SHAPE, torch.float32)
PASSWORD = "Resp-s3cret-Pa55"
PEER_GET = str(Path(__file__).with_name("lmcache_resp_get.py"))


def chunks(prefix: str, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [f"{prefix}@1@0@{i:x}@float" for i in range(n)], [torch.randn(SHAPE, generator=gen) for _ in range(n)]


def resp_store(port: int, connections: int = 1, **environ) -> RespChunkStore:
    address = store_address(f"resp://{HOST}:{port}", environ=environ)
    return open_store(address, connections=connections, timeout_s=10.0, chunk_header=HEADER)


def get(st, keys, expected=HEADER):
    bufs = [torch.zeros(SHAPE) for _ in keys]
    return st.get_many_into([(k, tensor_buffer(b), expected) for k, b in zip(keys, bufs)]), bufs


def engine_shape(make_engine) -> tuple[int, int, int, int]:
    g = make_engine().executor.worker.kv_pages.geometry
    return 2, g.num_layers, 256, g.num_kv_heads * g.head_dim


# -- the bytes on the server --------------------------------------------------------------------


def test_one_bare_key_holding_the_raw_payload_and_nothing_else(redis_server):
    keys, tensors = chunks("kvtool-test/resp-layout", 2, seed=70)
    with resp_store(redis_server.port) as st:
        assert st.put_many([(k, tensor_buffer(t), HEADER) for k, t in zip(keys, tensors)]) == [True, True]
    db = redis.Redis(host=HOST, port=redis_server.port)
    assert sorted(db.keys("kvtool-test/resp-layout@*")) == sorted(k.encode() for k in keys)
    for key, t in zip(keys, tensors):
        # The value is the KV_2LTD payload itself: no header, no metadata key, no expiry.
        assert db.get(key) == bytes(tensor_buffer(t))
        assert db.ttl(key) == -1
        assert db.get(key + "metadata") is None and db.get(key + "kv_bytes") is None
    db.close()


def test_an_engines_chunk_is_the_payload_the_redis_layout_holds(make_engine, redis_server):
    p = prompt(300, 71)
    fill(make_engine, f"resp://{HOST}:{redis_server.port}", [p])
    fill(make_engine, f"redis://{HOST}:{redis_server.port}/5", [p])
    (key,) = chunk_keys(p)
    assert key.startswith("kvtool-test/redis@1@0@") and key.endswith("@float")  # CacheEngineKey.to_string()
    db, db5 = redis.Redis(host=HOST, port=redis_server.port), redis.Redis(host=HOST, port=redis_server.port, db=5)
    value = db.get(key)
    assert len(value) == 4 * torch.Size(engine_shape(make_engine)).numel()
    assert value == db5.get(key + "kv_bytes")  # byte for byte the payload LMCache's RedisConnector stores
    assert db.keys(key + "*") == [key.encode()]  # only the full chunk: the 44-token tail is not stored
    db.close()
    db5.close()


# -- round trips, refusals, misses --------------------------------------------------------------


@pytest.mark.parametrize("connections", [1, 4])
def test_round_trip(redis_server, connections):
    keys, tensors = chunks(f"kvtool-test/resp-rt{connections}", 6, seed=72 + connections)
    with resp_store(redis_server.port, connections) as st:
        assert st.put_many([(k, tensor_buffer(t), HEADER) for k, t in zip(keys, tensors)]) == [True] * 6
        assert st.exist_many([*keys, "kvtool-test/resp-rt@1@0@ffff@float"]) == [True] * 6 + [False]
        results, bufs = get(st, keys)
    assert results == [HEADER] * 6
    assert all(torch.equal(b, t) for b, t in zip(bufs, tensors))


def test_wrong_size_is_refused_and_the_connection_stays_in_step(redis_server):
    keys, tensors = chunks("kvtool-test/resp-wrong", 3, seed=77)
    db = redis.Redis(host=HOST, port=redis_server.port)
    with resp_store(redis_server.port) as st:
        assert st.put_many([(k, tensor_buffer(t), HEADER) for k, t in zip(keys, tensors)]) == [True] * 3
        db.set(keys[0], bytes(tensor_buffer(tensors[0]))[:-4])  # one float short
        db.set(keys[1], bytes(tensor_buffer(tensors[1])) + b"\0" * 4)  # one float over
        results, bufs = get(st, keys)
        partial = kv_chunk_header((2, 4, 255, 520), torch.float32)
        again, _ = get(st, [keys[2]], expected=partial)
    for key, result, found in zip(keys, results[:2], (HEADER.length - 4, HEADER.length + 4)):
        assert isinstance(result, KVRefused)
        assert str(result) == f"chunk {key} length: expected {HEADER.length} (a full chunk), found {found}"
    assert not bufs[0].any() and not bufs[1].any()  # never written
    assert results[2] == HEADER and torch.equal(bufs[2], tensors[2])  # read after the refused ones
    assert isinstance(again[0], KVRefused) and "shape: expected (2, 4, 255, 520)" in str(again[0])
    db.close()


def test_a_partial_chunk_is_not_stored(redis_server):
    keys, _ = chunks("kvtool-test/resp-partial", 1, seed=78)
    short = torch.zeros((2, 4, 100, 520))
    with resp_store(redis_server.port) as st:
        assert st.put_many([(keys[0], tensor_buffer(short), kv_chunk_header(short.shape, torch.float32))]) == [False]
        assert st.exist_many(keys) == [False]


def test_a_missing_key_is_a_miss(redis_server):
    with resp_store(redis_server.port, 2) as st:
        results, bufs = get(st, ["kvtool-test/resp-missing@1@0@1@float", "kvtool-test/resp-missing@1@0@2@float"])
    assert results == [None, None] and not any(b.any() for b in bufs)


def test_engine_refuses_a_wrong_size_value_under_the_policy(make_engine, redis_server):
    p = prompt(300, 79)
    ref = make_engine().generate([p], GREEDY)[0]
    url = f"resp://{HOST}:{redis_server.port}"
    (key,) = chunk_keys(p)
    db = redis.Redis(host=HOST, port=redis_server.port)
    db.set(key, b"\x01" * (4 * (torch.Size(engine_shape(make_engine)).numel() - 1)))
    r = make_engine(kv_transfer_config=store_config(url, policy="fail")).generate([p], GREEDY)[0]
    assert r.finish_reason == "error" and r.output_token_ids == []
    assert "length: expected" in r.error
    # Never scattered: a recomputing engine over the same store gives the reference output.
    rec = make_engine(kv_transfer_config=store_config(url, policy="recompute"))
    assert rec.generate([p], GREEDY)[0].output_token_ids == ref.output_token_ids
    db.close()


def test_fill_then_a_new_engine_loads_every_full_chunk(make_engine, redis_server):
    url = f"resp://{HOST}:{redis_server.port}"
    prompts = [prompt(600, 73), prompt(300, 74)]
    ref = make_engine().generate(prompts, GREEDY)
    fill(make_engine, url, prompts, connections=1)
    again = make_engine(kv_transfer_config=store_config(url, connections=4)).generate(prompts, GREEDY)
    assert [r.stats.num_external_loaded_tokens for r in again] == [512, 256]
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in ref]


def test_blake3_mode_checks_each_payload_against_its_digest(make_engine, redis_server):
    # The default key mode: keys fold in the writer's identity and every chunk has a payload
    # digest beside it (verify_payload on), the one check resp:// has beyond a value's length.
    url = f"resp://{HOST}:{redis_server.port}"
    p = prompt(600, 81)
    ref = make_engine().generate([p], GREEDY)[0]
    mode = {"hash_algo": "blake3", "model_name": "kvtool-test/resp-blake3"}  # keys of this test alone
    fill(make_engine, url, [p], **mode)
    again = make_engine(kv_transfer_config=store_config(url, **mode)).generate([p], GREEDY)[0]
    # Chunks of one block (16 tokens) in this mode: every full block of the prompt.
    assert again.stats.num_external_loaded_tokens == 592 and again.output_token_ids == ref.output_token_ids
    db = redis.Redis(host=HOST, port=redis_server.port)
    keys = db.keys("kvtool-test/resp-blake3@*")
    chunks = [k for k in keys if db.strlen(k) > 64]  # the digests are 32 bytes each
    assert len(chunks) == 37 and len(keys) == 2 * 37
    for key in chunks:  # one byte changed in place: the length still fits
        value = bytearray(db.get(key))
        value[1000] ^= 0x40
        db.set(key, bytes(value))
    r = make_engine(kv_transfer_config=store_config(url, **mode)).generate([p], GREEDY)[0]
    assert r.finish_reason == "error" and r.output_token_ids == [] and "digest" in r.error
    db.close()


def test_auth_with_lmcaches_environment_variables(tmp_path):
    server = RedisServer(free_port(), tmp_path / "auth", ["--requirepass", PASSWORD]).start()
    try:
        keys, tensors = chunks("kvtool-test/resp-auth", 1, seed=75)
        with resp_store(server.port, **{"LMCACHE_RESP_PASSWORD": PASSWORD}) as st:
            assert st.health()
            assert st.put_many([(keys[0], tensor_buffer(tensors[0]), HEADER)]) == [True]
            results, bufs = get(st, keys)
        assert results == [HEADER] and torch.equal(bufs[0], tensors[0])
        with resp_store(server.port) as st, pytest.raises(ConfigError, match="refused the credentials"):
            st.health()
    finally:
        server.stop()


# -- the URL ------------------------------------------------------------------------------------


def test_url_forms_and_credentials():
    a = parse_store_url("resp://127.0.0.1:6390", environ={})
    assert (a.scheme, a.nodes, a.db, a.username, a.password, a.describe()) == (
        "resp", (("127.0.0.1", 6390),), 0, None, None, "resp://127.0.0.1:6390")
    b = parse_store_url(f"resp://alice:{PASSWORD}@h:1", environ={"LMCACHE_RESP_PASSWORD": "other"})
    assert (b.username, b.password) == ("alice", PASSWORD)  # the URL wins
    assert PASSWORD not in repr(b) + b.describe()
    env = {"LMCACHE_RESP_USERNAME": "bob", "LMCACHE_RESP_PASSWORD": "lm-pw"}
    assert (lambda c: (c.username, c.password))(parse_store_url("resp://h:1", environ=env)) == ("bob", "lm-pw")
    kvtool_first = parse_store_url("resp://h:1", environ={**env, "KVTOOL_REDIS_PASSWORD": "kv-pw"})
    assert kvtool_first.password == "kv-pw"


@pytest.mark.parametrize("url, message", [
    ("resp://h", "is not a resp://HOST:PORT URL"),
    ("resp://h:0", "is not a resp://HOST:PORT URL"),
    ("resp://:6379", "is not a resp://HOST:PORT URL"),
    ("resp://h:99999", "has an invalid port"),
    ("resp://h:1/2", "takes one HOST:PORT and no /DB or ?options"),
    ("resp://h:1?ssl_cert_reqs=none", "takes one HOST:PORT and no /DB or ?options"),
    ("resp://h:1,h:2", "takes one HOST:PORT and no /DB or ?options"),
    (f"resp://u:{PASSWORD}@h", "is not a resp://HOST:PORT URL"),
    ("resps://h:1", "scheme 'resps' is not one of"),
])
def test_bad_urls_are_one_line_config_errors(url, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        parse_store_url(url, environ={})
    assert "\n" not in str(e.value) and PASSWORD not in str(e.value)


def test_layout_settings():
    with pytest.raises(ConfigError, match="save_unfull_chunk must be false for resp://"):
        store_address("resp://h:1", save_unfull_chunk=True)
    with pytest.raises(ConfigError, match="apply to valkey:// only, not resp://"):
        store_address("resp://h:1", valkey_enable_ttl=True)


# -- LMCache's own resp:// connector (peer environment) -------------------------------------------


def lmcache_peer(script: str, *args: str) -> dict:
    env = peer_env(PYTHONPATH=str(peer_script("lmcache_objects.py").parent))
    proc = subprocess.run([str(require_peer_python()), script, *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"{script} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


@pytest.mark.peer
def test_a_chunk_kvtool_stores_is_read_by_lmcaches_resp_connector(make_engine, redis_server, tmp_path):
    url = f"resp://{HOST}:{redis_server.port}"
    p = prompt(300, 76)
    fill(make_engine, url, [p])
    (key,) = chunk_keys(p)
    shape = engine_shape(make_engine)
    out = tmp_path / "got.bin"
    answer = lmcache_peer(PEER_GET, url, key, ",".join(map(str, shape)), "float32", str(out))
    assert answer == {"hit": True, "shape": list(shape), "dtype": "float32", "fmt": "KV_2LTD", "fmt_code": 1,
                      "length": 4 * torch.Size(shape).numel()}
    db = redis.Redis(host=HOST, port=redis_server.port)
    assert out.read_bytes() == db.get(key)  # bit for bit
    db.close()


@pytest.mark.peer
def test_a_chunk_lmcaches_resp_connector_stores_is_loaded_by_kvtool(make_engine, redis_server, tmp_path):
    url = f"resp://{HOST}:{redis_server.port}"
    p = prompt(300, 80)
    ref = make_engine().generate([p], GREEDY)[0]
    # The KV of the prompt's first chunk as kvtool computes it, taken out of the store again.
    fill(make_engine, url, [p])
    (key,) = chunk_keys(p)
    db = redis.Redis(host=HOST, port=redis_server.port)
    kv = db.get(key)
    assert db.delete(key) == 1
    payload = tmp_path / "chunk.bin"
    payload.write_bytes(kv)
    shape = engine_shape(make_engine)
    stored = lmcache_peer(str(peer_script("lmcache_store_client.py")), "put", url, key, ",".join(map(str, shape)),
                          "float32", str(payload))
    assert stored == {"stored": True}
    assert db.get(key) == kv and db.ttl(key) == -1  # LMCache writes the same bytes, no expiry
    r = make_engine(kv_transfer_config=store_config(url)).generate([p], GREEDY)[0]
    assert r.stats.num_external_loaded_tokens == 256
    assert r.output_token_ids == ref.output_token_ids
    db.close()
