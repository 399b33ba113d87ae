"""vLLM 0.33's OffloadingConnector keys: blocks_per_chunk, store_threshold / max_tracker_size."""

import json

import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.offloading.connector import OffloadingConnector
from kvtool.engine.connectors.offloading.settings import parse_settings
from kvtool.engine.connectors.offloading.store_filter import OfferCounter, make_offer_counter
from kvtool.engine.errors import ConfigError
from tests.unit.offload_replay import make_half, replay_kvtool


def refusal(extra: dict, block_size: int = 16) -> str:
    with pytest.raises(ConfigError) as e:
        parse_settings(extra, block_size)
    message = str(e.value)
    assert "\n" not in message and message.startswith("invalid OffloadingConnector"), message
    return message


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


def test_store_threshold_below_two_stores_on_the_first_offer():
    for threshold in (0, 1):
        assert parse_settings({"store_threshold": threshold}, 16).store_threshold == threshold
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


@pytest.mark.parametrize("extra, needle", [
    ({"store_threshold": -1}, "store_threshold must be an integer >= 0"),
    ({"max_tracker_size": 0}, "max_tracker_size must be an integer >= 1"),
])
def test_out_of_range_values_are_refused(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_settings(extra, 16)
