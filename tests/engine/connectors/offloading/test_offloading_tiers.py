"""CPU tier slots and the OffloadingConnector's settings."""


import json

import msgspec
import pytest

from kvtool.engine.connectors.base import ConnectorContext, EngineIdentity
from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.offloading.connector import OffloadingConnector, parse_settings
from kvtool.engine.connectors.offloading.cpu_tier import HostPool, SlotIndex, plan_num_slots
from kvtool.engine.errors import ConfigError
from kvtool.engine.kv.pages import KVGeometry

G = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")


def test_lru_eviction_skips_pinned_slots():
    tier = SlotIndex(num_slots=2)
    a = tier.allocate(b"a")
    b = tier.allocate(b"b")
    tier.unpin(b)
    # a is pinned (a transfer in flight): c must take b's slot although a is older.
    c = tier.allocate(b"c")
    assert c == b and tier.lookup(b"b") is None and tier.lookup(b"a") == a
    assert tier.allocate(b"d") is None  # every slot pinned
    tier.unpin(a)
    tier.unpin(c)
    tier.touch([b"a"])  # a is now the most recently used
    d = tier.allocate(b"d")
    assert d == c and tier.lookup(b"a") == a


def test_drop_while_pinned_frees_at_last_unpin():
    tier = SlotIndex(num_slots=1)
    s = tier.allocate(b"k")
    tier.drop(b"k")
    assert tier.lookup(b"k") is None
    assert tier.allocate(b"other") is None  # still pinned by the transfer
    tier.unpin(s)
    assert tier.allocate(b"other") == s
    assert HostPool(G, blocks_per_slot=2, num_slots=1, pin_memory=False).slot(s).shape == (2, 2, 2, 4, 1, 4)


def test_sizing_from_bytes_or_blocks():
    # vLLM's rule: cpu_bytes_to_use over page-aligned offload blocks of every rank's shard.
    assert plan_num_slots(65536, 65536 * 5 + 7, None) == 5
    assert plan_num_slots(G.bytes_per_block * 2, 4096 * 5 + 7, None) == 5  # 512 bytes take a page
    assert plan_num_slots(4097, 8192 * 3, None) == 3
    assert plan_num_slots(65536, None, 3) == 3
    assert plan_num_slots(65536, 1, None) == 1  # always at least one slot


def test_settings_and_one_line_refusal_for_unknown_keys():
    s = parse_settings({"cpu_bytes_to_use": 1 << 20, "block_size": 32, "spec_name": "CPUOffloadingSpec"}, 16)
    assert s.offload_block_tokens == 32 and s.cpu_bytes_to_use == 1 << 20 and s.layerwise is False
    assert parse_settings({"layerwise": True}, 16).layerwise is True
    with pytest.raises(ConfigError, match="unknown key 'store_treshold' \\(did you mean store_threshold\\?\\)") as e:
        parse_settings({"cpu_bytes_to_use": 1 << 20, "store_treshold": 2}, 16)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"offload_block_tokens": 24}, "not a multiple of the block size 16"),
        ({"num_cpu_blocks": 0}, "num_cpu_blocks must be an integer >= 1"),
        ({"eviction_policy": "fifo"}, "eviction_policy must be one of 'lru', 'arc'"),
        ({"root_dir": 5}, "root_dir"),
        ({"group_idx": 1}, "group_idx"),
        ({"layerwise": "yes"}, "layerwise"),
    ],
)
def test_bad_settings_are_refused(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_settings(extra, 16)


def test_cpu_bytes_to_use_counts_every_tensor_parallel_rank():
    """vLLM sizes the CPU tier from cpu_bytes_to_use over all workers (cpu/spec.py): at TP 2 the
    same bytes give half the slots that one rank holding every head would get."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")

    def num_slots(tp_size, tp_rank, heads, extra):
        config = parse_kv_transfer_config(json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                                      "kv_connector_extra_config": extra}))
        identity = EngineIdentity(model_name="m", architecture="a", config_digest="c", weights_digest="w",
                                  rope_digest="r", sliding_window=0, weight_quantization="none", kv_dtype="float32",
                                  kv_quantization="none", block_hash_algo="sha256_cbor", none_hash_seed="s",
                                  geometry=msgspec.structs.replace(geometry, num_kv_heads=heads),
                                  tp_size=tp_size, tp_rank=tp_rank, model_num_kv_heads=2)
        return OffloadingConnector._plan(ConnectorContext(config=config, identity=identity, none_hash=bytes(32)))[2]

    block = geometry.bytes_per_block  # 32 KiB: page-aligned already
    assert num_slots(1, 0, 2, {"cpu_bytes_to_use": 100 * block}) == 100
    assert num_slots(2, 0, 1, {"cpu_bytes_to_use": 100 * block}) == 100  # each rank: 100 half-size slots
    assert num_slots(2, 1, 1, {"cpu_bytes_to_use": 100 * block, "block_size": 64}) == 25
    assert num_slots(2, 1, 1, {"num_cpu_blocks": 7}) == 7
