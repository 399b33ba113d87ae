"""blake3 mode: a chunk stored by another checkpoint under the same model name is a miss, never a load.

Every engine here keys its chunks under the same `model_name`; they differ only in their weights
(dummy weights of another seed, or another checkpoint directory). Peer-mode keys cannot tell
them apart, so only kvtool's own blake3 keys, which carry the writer's identity digest, keep
the second engine from loading the first one's KV. Engines with identical weights still share
chunks, from another directory and another engine object alike. The stores are LMCache's own
server and a real redis-server in LMCache's Redis and Valkey layouts.
"""

from __future__ import annotations

import json

import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MODEL_NAME = "shared/tiny"
NUM_TOKENS = 64  # four 16-token chunks: blake3 mode's chunk is the block


def store_config(store: dict, **extra):
    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "LMCacheConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {**store, "model_name": MODEL_NAME, **extra},
    }))


def prompt(seed: int) -> list[int]:
    return [(i * 31 + seed * 11) % 240 + 5 for i in range(NUM_TOKENS)]


@pytest.fixture(params=["lm", "redis", "valkey"])
def store(request) -> dict:
    """The connector keys that point at one store, shared by every engine of a test."""
    if request.param == "lm":
        server = request.getfixturevalue("lmcache_server")
        return {"host": server.host, "port": server.port}
    server = request.getfixturevalue("redis_server")
    db = {"redis": "/5", "valkey": ""}[request.param]
    return {"remote_url": f"{request.param}://127.0.0.1:{server.port}{db}"}


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """A tiny checkpoint with other weights (seed 1) than tiny_model_dir's (seed 0)."""
    from kvtool.engine.presets.catalog import create_model_dir

    d = tmp_path_factory.mktemp("other") / "tiny"
    create_model_dir(d, preset="tiny", seed=1)
    return d


@pytest.fixture(scope="module")
def same_checkpoint(tmp_path_factory):
    """A copy of tiny_model_dir's checkpoint (seed 0) in another directory."""
    from kvtool.engine.presets.catalog import create_model_dir

    d = tmp_path_factory.mktemp("same") / "tiny"
    create_model_dir(d, preset="tiny", seed=0)
    return d


def run(engine, p):
    out = engine.generate([p], GREEDY)[0]
    engine.executor.worker.connector.flush()
    return out


@pytest.mark.parametrize("variant", ["dummy-seed", "checkpoint"])
def test_other_weights_under_the_same_model_name_miss(make_engine, store, other_checkpoint, same_checkpoint,
                                                      variant):
    kind = store.get("remote_url", "lm").partition(":")[0]
    p = prompt({"lm": 61, "redis": 62, "valkey": 63}[kind] + (0 if variant == "dummy-seed" else 100))
    if variant == "dummy-seed":
        first, second, again = ({"load_format": "dummy", "seed": s} for s in (1, 2, 1))
    else:
        first, second, again = {}, {"model": str(other_checkpoint)}, {"model": str(same_checkpoint)}

    writer = run(make_engine(kv_transfer_config=store_config(store), **first), p)
    assert writer.stats.num_external_loaded_tokens == 0
    assert writer.finish_reason != "error"

    # Same model name, other weights: nothing is loaded, and the output is that engine's own.
    ref = make_engine(**second).generate([p], GREEDY)[0]
    other = run(make_engine(kv_transfer_config=store_config(store), **second), p)
    assert other.stats.num_external_loaded_tokens == 0
    assert other.output_token_ids == ref.output_token_ids

    # Same weights (a new engine; for a checkpoint, a copy in another directory): every chunk hits.
    same = run(make_engine(kv_transfer_config=store_config(store), **again), p)
    assert same.stats.num_external_loaded_tokens == NUM_TOKENS
    assert same.output_token_ids == writer.output_token_ids


def test_peer_mode_keys_cannot_tell_the_checkpoints_apart(make_engine, lmcache_server, other_checkpoint):
    """Why blake3 mode needs the digest: vllm-mode keys are the peer's, model name and tokens only."""
    store = {"host": lmcache_server.host, "port": lmcache_server.port}
    a = make_engine(kv_transfer_config=store_config(store, hash_algo="vllm", chunk_tokens=16))
    b = make_engine(kv_transfer_config=store_config(store, hash_algo="vllm", chunk_tokens=16),
                    model=str(other_checkpoint))
    assert a.scheduler.connector.key_settings.identity_digest is None
    assert a.scheduler.connector.key_settings == b.scheduler.connector.key_settings
