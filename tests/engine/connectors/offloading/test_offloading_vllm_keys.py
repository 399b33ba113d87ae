"""vLLM 0.33's OffloadingConnector keys: spec_name, secondary_tiers, blocks_per_chunk,
eviction_policy, store_threshold / max_tracker_size, the tiering keys, and what is refused."""

import json

import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.offloading.connector import OffloadingConnector
from kvtool.engine.connectors.offloading.settings import parse_settings
from kvtool.engine.connectors.offloading.store_filter import OfferCounter, make_offer_counter
from kvtool.engine.errors import ConfigError
from tests.support.offload_replay import make_half, replay_kvtool


def refusal(extra: dict, block_size: int = 16) -> str:
    with pytest.raises(ConfigError) as e:
        parse_settings(extra, block_size)
    message = str(e.value)
    assert "\n" not in message and message.startswith("invalid OffloadingConnector"), message
    return message


TIERING = {"spec_name": "TieringOffloadingSpec"}


def test_blocks_per_chunk_counts_engine_blocks_and_excludes_block_size():
    assert parse_settings({"blocks_per_chunk": 4}, 16).offload_block_tokens == 64
    assert parse_settings({"blocks_per_chunk": 1}, 32).offload_block_tokens == 32
    assert parse_settings({}, 16).offload_block_tokens == 16
    for other in ("block_size", "offload_block_tokens"):
        assert "give one of block_size (offload_block_tokens) or blocks_per_chunk" in refusal(
            {"blocks_per_chunk": 4, other: 64})
    assert "blocks_per_chunk must be an integer >= 1" in refusal({"blocks_per_chunk": 0})
    assert "more than 1048576" in refusal({"blocks_per_chunk": 1 << 20})
    config = parse_kv_transfer_config(json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                                  "kv_connector_extra_config": {"blocks_per_chunk": 4}}))
    assert OffloadingConnector.hit_unit_tokens(config, 16) == 64


def test_the_tiering_spec_maps_an_fs_tier_onto_the_disk_tier():
    s = parse_settings({**TIERING, "cpu_bytes_to_use": 10 << 30,
                        "secondary_tiers": [{"type": "fs", "root_dir": "/srv/kv"}]}, 16)
    assert s.root_dir == "/srv/kv" and s.cpu_bytes_to_use == 10 << 30  # 10 GiB fits this machine's check
    assert s.disk_events is False and s.disk_locality is None  # vLLM's fs tier: no events unless asked
    s = parse_settings({**TIERING, "secondary_tiers": [{"type": "fs", "root_dir": "/srv/kv", "locality": "REMOTE",
                                                        "enable_kv_events": True}], "tier_poll_interval_s": 0}, 16)
    assert (s.disk_events, s.disk_locality, s.tier_poll_interval_s) == (True, "REMOTE", 0.0)
    assert parse_settings({**TIERING, "secondary_tiers": []}, 16).root_dir is None  # CPU only, as in vLLM
    assert parse_settings({**TIERING, "root_dir": "/srv/kv"}, 16).disk_events is True  # kvtool's key
    assert parse_settings({"root_dir": "/srv/kv"}, 16).root_dir == "/srv/kv"
    config = parse_kv_transfer_config(json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                                  "kv_connector_extra_config": {**TIERING, "secondary_tiers": [
                                                      {"type": "fs", "root_dir": "/srv/kv"}]}}))
    assert OffloadingConnector.outlives_engine(config)


@pytest.mark.parametrize("extra, needle", [
    ({"secondary_tiers": [{"type": "fs", "root_dir": "/x"}]},
     "secondary_tiers is read only with spec_name 'TieringOffloadingSpec' (vLLM ignores it under 'CPUOffloadingSpec')"),
    ({"tier_poll_interval_s": 0.01}, "tier_poll_interval_s is read only with spec_name 'TieringOffloadingSpec'"),
    ({**TIERING, "secondary_tiers": {"type": "fs"}}, "secondary_tiers must be a JSON array"),
    ({**TIERING, "secondary_tiers": ["fs"]}, "each entry must be a JSON object"),
    ({**TIERING, "secondary_tiers": [{"root_dir": "/x"}]}, "an entry needs a type"),
    ({**TIERING, "secondary_tiers": [{"type": "p2p"}]},
     "vLLM's 'p2p' tier is not supported; kvtool implements only the fs"),
    ({**TIERING, "secondary_tiers": [{"type": "obj", "store_config": {}}]}, "vLLM's 'obj' tier is not supported"),
    ({**TIERING, "secondary_tiers": [{"type": "kvcr"}]}, "vLLM's 'kvcr' tier is not supported"),
    ({**TIERING, "secondary_tiers": [{"type": "example"}]}, "vLLM's 'example' tier is not supported"),
    ({**TIERING, "secondary_tiers": [{"type": "MyTier", "module_path": "my.tiers"}]},
     "an out-of-tree 'MyTier' tier is not supported"),
    ({**TIERING, "secondary_tiers": [{"type": "fs", "root_dir": "/a"}, {"type": "fs", "root_dir": "/b"}]},
     "at most one entry (of type fs), got 2"),
    ({**TIERING, "secondary_tiers": [{"type": "fs"}]}, "the fs tier needs root_dir"),
    ({**TIERING, "secondary_tiers": [{"type": "fs", "root_dir": "/a", "n_read_threads": 8}]},
     "secondary_tiers config: n_read_threads is not supported: kvtool's disk tier is read by the worker half"),
    ({**TIERING, "secondary_tiers": [{"type": "fs", "root_dir": "/a", "n_write_threads": 8}]},
     "n_write_threads is not supported"),
    ({**TIERING, "secondary_tiers": [{"type": "fs", "root_dir": "/a", "backpressure": {}}]},
     "backpressure is not supported: kvtool's disk tier never drops a store under pressure"),
    ({**TIERING, "secondary_tiers": [{"type": "fs", "root_dir": "/a", "module_path": "x"}]}, "module_path is not"),
    ({**TIERING, "secondary_tiers": [{"type": "fs", "root_dir": "/a", "locality": "local"}]},
     "locality must be one of 'LOCAL', 'REMOTE'"),
    ({**TIERING, "secondary_tiers": [{"type": "fs", "root_dir": "/a", "rootdir": "/b"}]},
     "unknown key 'rootdir' (did you mean root_dir?)"),
    ({**TIERING, "secondary_tiers": [{"type": "fs", "root_dir": "/a"}], "root_dir": "/b"}, "give the disk tier once"),
    ({**TIERING, "tier_poll_interval_s": "fast"}, "tier_poll_interval_s must be a number"),
    ({**TIERING, "backpressure": {"backpressure_cls": "EMABackpressureDetector"}}, "backpressure is not supported"),
    ({**TIERING, "store_threshold": 2},
     "store_threshold 2 is not supported with TieringOffloadingSpec (as in vLLM); values below 2 turn the filter off"),
    ({"spec_name": "SharedStorageOffloadingSpec", "spec_module_path": "llmd_fs_backend.spec"},
     "spec_module_path is not supported: kvtool implements CPUOffloadingSpec and TieringOffloadingSpec"),
    ({"spec_name": "SharedStorageOffloadingSpec"},
     "spec_name must be one of 'CPUOffloadingSpec', 'TieringOffloadingSpec'"),
    ({"eviction_policy": "MyPolicy", "cache_policy_module_path": "my.policies"},
     "cache_policy_module_path is not supported: kvtool's eviction policies are its own lru and arc"),
    ({"store_threshold": -1}, "store_threshold must be an integer >= 0"),
    ({"max_tracker_size": 0}, "max_tracker_size must be an integer >= 1"),
    ({"canonical_layout": True}, "canonical_layout true is not supported: kvtool's CPU tier keeps its own"),
    ({"self_describing_kv_events": True}, "self_describing_kv_events true is not supported"),
    ({"sync_load_budget_bytes": -1}, "sync_load_budget_bytes"),
])
def test_what_kvtool_cannot_honour_is_refused_in_one_line(extra, needle):
    assert needle in refusal(extra)


def test_vllm_033s_load_budget_layout_and_event_keys_run_unchanged_at_their_defaults():
    """A vLLM 0.33 config that sets sync_load_budget_bytes (kvtool loads every hit inside its step,
    so the value changes nothing), canonical_layout false and self_describing_kv_events false."""
    extra = {"cpu_bytes_to_use": "1G", "sync_load_budget_bytes": "64m", "canonical_layout": False,
             "self_describing_kv_events": False}
    s = parse_settings(extra, 16)
    assert (s.sync_load_budget_bytes, s.canonical_layout, s.self_describing_kv_events) == (64_000_000, False, False)
    config = parse_kv_transfer_config(json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                                  "kv_connector_extra_config": extra}))
    assert config.kv_connector_extra_config["sync_load_budget_bytes"] == "64m"


def test_store_threshold_below_two_stores_on_the_first_offer():
    for threshold in (0, 1):
        assert parse_settings({**TIERING, "store_threshold": threshold}, 16).store_threshold == threshold
        assert make_offer_counter(threshold, 10) is None
    s = parse_settings({"store_threshold": 3, "max_tracker_size": 100}, 16)
    assert (s.store_threshold, s.max_tracker_size) == (3, 100)
    assert parse_settings({}, 16).max_tracker_size == 64_000  # vLLM's default


def test_the_offer_counter_is_an_lru_table_of_max_tracker_size_keys():
    counter = OfferCounter(threshold=2, max_keys=3)
    counter.record_offer([b"a", b"b", b"c"])
    assert not any(counter.admits(k) for k in (b"a", b"b", b"c"))
    counter.record_offer([b"a"])
    assert counter.admits(b"a")
    counter.record_offer([b"d"])  # the table is full: d takes the least recently offered key's place (b)
    counter.record_offer([b"b"])  # b starts over at one offer, in c's place
    assert not counter.admits(b"b") and len(counter) == 3
    counter.record_offer([b"c"])
    assert not counter.admits(b"c")
    # An offer whose own known keys fill the table: its new keys are not counted at all.
    counter = OfferCounter(threshold=2, max_keys=2)
    counter.record_offer([b"a", b"b"])
    counter.record_offer([b"a", b"b", b"x"])
    assert counter.admits(b"a") and counter.admits(b"b") and len(counter) == 2
    counter.record_offer([b"x"])
    assert not counter.admits(b"x")  # x replaced a (the least recent) and has one offer


def test_store_threshold_stores_a_chunk_on_its_threshold_th_offer():
    for threshold, stored_on in ((2, 1), (3, 2)):
        half = make_half(num_cpu_blocks=8, store_threshold=threshold)
        replayed = replay_kvtool(half, [["a0", "a1"]] * 4)
        assert [r["stored"] for r in replayed][stored_on] == ["a0", "a1"]
        assert [r["hits"] for r in replayed] == [0] * (stored_on + 1) + [2] * (3 - stored_on)
    # A chunk offered once per request, however many requests share it: the head of a prefix
    # that every request sends crosses the threshold first.
    half = make_half(num_cpu_blocks=8, store_threshold=2)
    replayed = replay_kvtool(half, [["p0", "a1"], ["p0", "b1"], ["p0", "a1"]])
    assert [r["stored"] for r in replayed] == [[], ["p0"], ["a1"]]
