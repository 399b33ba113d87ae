"""Each connector answers for itself (hit unit, whether its KV outlives the engine, where hits
come from), through its own settings parser: its aliases and defaults live in one place."""

import json

import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.registry import resolve_connector
from kvtool.workloads.arms import hit_unit_tokens, parse_arm_spec


def ktc(name, extra):
    return parse_kv_transfer_config(json.dumps({"kv_connector": name, "kv_role": "kv_both",
                                                "kv_connector_extra_config": extra}))


@pytest.mark.parametrize("name, extra, unit", [
    ("OffloadingConnector", {}, 16),
    ("OffloadingConnector", {"offload_block_tokens": 64}, 64),
    ("OffloadingConnector", {"block_size": 256}, 256),  # vLLM's name for it
    ("LMCacheConnectorV1", {}, 16),  # blake3 keys: one chunk per engine block
    ("LMCacheConnectorV1", {"hash_algo": "vllm"}, 256),
    ("LMCacheConnectorV1", {"lmcache.chunk_size": 128, "hash_algo": "vllm"}, 128),
    ("LMCacheConnectorV1", {"lmcache.pre_caching_hash_algorithm": "sha256_cbor"}, 256),
])
def test_hit_unit_comes_from_the_connector(name, extra, unit):
    config = ktc(name, extra)
    assert resolve_connector(config).hit_unit_tokens(config, 16) == unit
    arm = parse_arm_spec(f"x={json.dumps(json.loads(config_doc(name, extra)))}")
    assert hit_unit_tokens(arm, 16) == unit


def config_doc(name, extra):
    return json.dumps({"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": extra})


def test_what_outlives_the_engine_and_where_hits_come_from():
    cpu, disk = ktc("OffloadingConnector", {}), ktc("OffloadingConnector", {"root_dir": "/nonexistent/tier"})
    lm = ktc("LMCacheConnectorV1", {"remote_url": "lm://127.0.0.1:1"})
    off = resolve_connector(cpu)
    assert not off.outlives_engine(cpu) and off.outlives_engine(disk)
    assert off.hit_source(disk, rebuilt=True) == "disk" and off.hit_source(disk, rebuilt=False) == "cpu"
    assert resolve_connector(lm).outlives_engine(lm) and resolve_connector(lm).hit_source(lm, True) == "lmcache"
    arm = parse_arm_spec("d=" + config_doc("OffloadingConnector", {"root_dir": "/nonexistent/tier"}))
    assert arm.survives_restart and arm.rebuild_before_reuse
