"""The tensor-parallel pieces of the connectors: rank identities, the rank tally, the key's rank."""

import msgspec
import pytest

from kvtool.engine.connectors.base import EngineIdentity, identity_of_rank
from kvtool.engine.connectors.lmcache.chunk_fit import ChunkGeometry, chunk_geometry_of_rank, chunk_problem
from kvtool.engine.connectors.lmcache.keys import key_for_worker, parse_key
from kvtool.engine.connectors.lmcache.settings import parse_settings
from kvtool.engine.connectors.lmcache.stores.protocol import kv_chunk_header
from kvtool.engine.errors import ConfigError
from kvtool.engine.kv.pages import KVGeometry
from kvtool.engine.models.shard_layout import TPRank

GEOMETRY = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")


def identity(**kw) -> EngineIdentity:
    fields = dict(model_name="m", architecture="a", config_digest="c", weights_digest="w", rope_digest="r",
                  sliding_window=0, weight_quantization="none", kv_dtype="float32", kv_quantization="none",
                  geometry=GEOMETRY, block_hash_algo="sha256_cbor", none_hash_seed="s", model_num_kv_heads=3)
    fields.update(kw)
    return EngineIdentity(**fields)


def test_identity_of_rank_takes_the_shard_from_the_model_heads():
    ranks = [identity_of_rank(identity(), 2, r) for r in range(2)]
    assert [(i.tp_size, i.tp_rank, i.geometry.num_kv_heads) for i in ranks] == [(2, 0, 2), (2, 1, 1)]
    # From a rank's identity as well: the model's heads travel with it.
    assert identity_of_rank(ranks[1], 2, 0).geometry.num_kv_heads == 2
    assert identity_of_rank(identity(model_num_kv_heads=0), 1, 0).geometry.num_kv_heads == 3
    # A replicated (unsharded) model: every rank holds every head.
    replicated = msgspec.structs.replace(identity(), tp_size=2)
    assert identity_of_rank(replicated, 2, 1).geometry.num_kv_heads == 3
    with pytest.raises(ConfigError, match="model_num_kv_heads"):
        identity_of_rank(msgspec.structs.replace(ranks[0], model_num_kv_heads=0), 2, 1)


def test_key_for_worker_changes_only_the_worker_id():
    key = "Qwen/Qwen3-0.6B@2@0@657144e4621aa68@bfloat16@cachesalt%ab"
    other = parse_key(key_for_worker(key, 1))
    assert (other.worker_id, other.world_size, other.model_name, other.dtype_str) == (1, 2, "Qwen/Qwen3-0.6B", "bfloat16")
    assert key_for_worker(key, 1) == key.replace("@2@0@", "@2@1@")


@pytest.mark.parametrize("extra, tp, expected", [
    ({}, TPRank(2, 1), (2, 1)),
    ({"world_size": 2}, TPRank(2, 1), (2, 1)),
    ({"world_size": 2, "worker_id": 1}, TPRank(2, 1), (2, 1)),
    ({}, TPRank(), (1, 0)),
    ({"world_size": 2, "worker_id": 1}, None, (2, 1)),  # no engine: a config check only
])
def test_the_key_rank_is_the_engine_rank(extra, tp, expected):
    settings, keys = parse_settings(extra, "m", "float32", 16, tp=tp)
    assert (keys.world_size, keys.worker_id) == (settings.world_size, settings.worker_id) == expected


@pytest.mark.parametrize("extra, tp, needle", [
    ({"world_size": 2, "worker_id": 1}, TPRank(), "world_size 2 disagrees with the engine's tensor-parallel size 1"),
    ({"worker_id": 1}, TPRank(), "worker_id 1 disagrees with the engine's tensor-parallel rank 0 (of 1)"),
    ({"worker_id": 0}, TPRank(2, 1), "worker_id 0 disagrees with the engine's tensor-parallel rank 1 (of 2)"),
])
def test_a_key_rank_other_than_the_engine_is_refused(extra, tp, needle):
    with pytest.raises(ConfigError) as e:
        parse_settings(extra, "m", "float32", 16, tp=tp)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_chunk_fit_is_per_rank_and_checks_dtype_and_length():
    import torch

    rank1 = chunk_geometry_of_rank(30, 3, 64, "float32", TPRank(2, 1))
    assert rank1 == ChunkGeometry(num_layers=30, kv_hidden_size=64, dtype="float32")
    assert chunk_geometry_of_rank(30, 3, 64, "float32", TPRank(2, 0)).kv_hidden_size == 128
    assert chunk_problem(kv_chunk_header((2, 30, 256, 64), torch.float32), 256, rank1) is None
    whole = kv_chunk_header((2, 30, 256, 192), torch.float32)
    assert chunk_problem(whole, 256, rank1) == "KV hidden size 192, expected 64"
    as_bf16 = kv_chunk_header((2, 30, 256, 64), torch.bfloat16)
    assert chunk_problem(as_bf16, 256, rank1) == "dtype bfloat16, expected float32"
    short = msgspec.structs.replace(kv_chunk_header((2, 30, 256, 64), torch.float32), length=10)
    assert chunk_problem(short, 256, rank1) == f"payload 10 bytes, expected {2 * 30 * 256 * 64 * 4}"
    with pytest.raises(ConfigError, match="not a torch dtype"):
        chunk_geometry_of_rank(30, 3, 64, "float99", TPRank())
