"""CPU tier slots and the OffloadingConnector's settings."""


import pytest

from kvtool.engine.connectors.offloading.connector import parse_settings
from kvtool.engine.connectors.offloading.cpu_tier import HostPool, SlotIndex, plan_num_slots
from kvtool.engine.errors import ConfigError
from kvtool.engine.kv_pages import KVGeometry

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
    tier.touch(b"a")  # a is now the most recently used
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
    slot_bytes = G.bytes_per_block * 2
    assert plan_num_slots(G, 2, slot_bytes * 5 + 7, None) == 5
    assert plan_num_slots(G, 2, None, 3) == 3
    assert plan_num_slots(G, 2, 1, None) == 1  # always at least one slot


def test_settings_and_one_line_refusal_for_unknown_keys():
    s = parse_settings({"cpu_bytes_to_use": 1 << 20, "block_size": 32, "spec_name": "CPUOffloadingSpec"}, 16)
    assert s.offload_block_tokens == 32 and s.cpu_bytes_to_use == 1 << 20 and s.layerwise is False
    assert parse_settings({"layerwise": True}, 16).layerwise is True
    with pytest.raises(ConfigError, match="unknown key 'store_threshold'; known keys: ") as e:
        parse_settings({"cpu_bytes_to_use": 1 << 20, "store_threshold": 2}, 16)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"offload_block_tokens": 24}, "not a multiple of the block size 16"),
        ({"num_cpu_blocks": 0}, "num_cpu_blocks must be an integer >= 1"),
        ({"eviction_policy": "arc"}, "eviction_policy"),
        ({"root_dir": 5}, "root_dir"),
        ({"group_idx": 1}, "group_idx"),
        ({"layerwise": "yes"}, "layerwise"),
    ],
)
def test_bad_settings_are_refused(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_settings(extra, 16)
