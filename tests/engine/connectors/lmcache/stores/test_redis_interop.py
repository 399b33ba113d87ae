"""kvtool and LMCache's own RedisConnector / RedisClusterConnector share chunks in Redis.

LMCache runs in the peer environment (scripts/peer-env, with redis-py) through
kvtool/peer/lmcache_store_client.py; the servers are real redis-server processes.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import redis
import torch

from kvtool.engine.params import SamplingParams
from kvtool.peer.env import peer_env, peer_script
from kvtool.workloads.redis_server import HOST
from tests.support.redis_chunks import chunk_keys, fill, prompt, store_config
from tests.support.peer_server import require_peer_python

peer = pytest.mark.peer
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def lmcache_store_client(*args: str) -> dict:
    proc = subprocess.run([str(require_peer_python()), str(peer_script("lmcache_store_client.py")), *args],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, env=peer_env(), timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"lmcache_store_client.py exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def raw_client(kind, request, db):
    if kind == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return cluster.url, redis.cluster.RedisCluster(host=HOST, port=cluster.nodes[0].port)
    server = request.getfixturevalue("redis_server")
    return f"redis://{HOST}:{server.port}/{db}", redis.Redis(host=HOST, port=server.port, db=db)


@peer
@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_a_chunk_lmcache_stores_is_loaded_by_kvtool(kind, make_engine, request, tmp_path):
    url, db = raw_client(kind, request, 7)
    p = prompt(300, 50 + (kind == "cluster"))
    ref = make_engine().generate([p], GREEDY)[0]
    # The KV of the prompt's first chunk, as kvtool computes it; then the store is emptied of it.
    fill(make_engine, url, [p])
    (key,) = chunk_keys(p)
    kv, ours = db.get(key + "kv_bytes"), db.get(key + "metadata")
    assert db.delete(key + "kv_bytes") + db.delete(key + "metadata") == 2
    g = make_engine().executor.worker.kv_pages.geometry
    shape = (2, g.num_layers, 256, g.num_kv_heads * g.head_dim)
    payload = tmp_path / "chunk.bin"
    payload.write_bytes(kv)
    # LMCache's own connector stores it.
    answer = lmcache_store_client("put", url, key, ",".join(map(str, shape)), "float32", str(payload))
    assert answer == {"stored": True}
    assert db.get(key + "metadata") == ours and db.get(key + "kv_bytes") == kv  # the same bytes kvtool writes
    reader = make_engine(kv_transfer_config=store_config(url))
    r = reader.generate([p], GREEDY)[0]
    assert r.stats.num_external_loaded_tokens == 256
    assert r.output_token_ids == ref.output_token_ids
    db.close()


@peer
@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_a_chunk_kvtool_stores_is_decoded_by_lmcache(kind, make_engine, request, tmp_path):
    url, db = raw_client(kind, request, 8)
    p = prompt(300, 52 + (kind == "cluster"))
    fill(make_engine, url, [p])
    (key,) = chunk_keys(p)
    out = tmp_path / "got.bin"
    answer = lmcache_store_client("get", url, key, str(out))
    g = make_engine().executor.worker.kv_pages.geometry
    shape = [2, g.num_layers, 256, g.num_kv_heads * g.head_dim]
    assert answer == {"hit": True, "shape": shape, "dtype": "float32", "fmt": "KV_2LTD", "fmt_code": 1,
                      "length": 4 * torch.Size(shape).numel()}
    assert out.read_bytes() == db.get(key + "kv_bytes")  # bit for bit
    db.close()
