"""The OffloadingConnector scheduler half's reset_cache: the CPU tier forgotten, the disk tier kept,
pinned slots waited for, KV events for what left; loads counted by the tier they came from."""

from kvtool.engine.events.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
from kvtool.engine.outputs import CPUTierUsage
from kvtool.engine.params import SamplingParams
from tests.support.offload_replay import make_half, offloading_config, prompt, replay_kvtool

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def test_reset_forgets_the_cpu_tier_and_keeps_the_disk_tier(make_engine, tmp_path):
    root = tmp_path / "tier"
    p = prompt(70, seed=1)
    ref = make_engine().generate([p], ONE)[0]
    engine = make_engine(kv_transfer_config=offloading_config(num_cpu_blocks=8, root_dir=str(root)),
                         enable_prefix_caching=False)
    half = engine.scheduler.connector
    engine.generate([p], ONE)
    engine.flush_connector()
    from_cpu = engine.generate([p], ONE)[0].stats  # the CPU tier holds every block
    assert from_cpu.num_external_loaded_tokens == 64 and from_cpu.num_external_loaded_from_disk == 0
    files = sorted(root.rglob("*.kvb"))
    assert len(half.slots) == 4 and len(half.disk) == 4 and len(files) == 4
    assert half.reset_cache() is True
    assert engine.stats().cpu_tier == CPUTierUsage(num_slots=8, num_filled=0, num_pinned=0)
    assert len(half.disk) == 4 and sorted(root.rglob("*.kvb")) == files
    # The next hit comes from disk, promoted into the CPU tier again.
    again = engine.generate([p], ONE)[0]
    assert again.stats.num_external_tokens == 64 and again.output_token_ids == ref.output_token_ids
    assert again.stats.num_external_loaded_from_disk == again.stats.num_external_loaded_tokens == 64
    assert engine.stats().external_tokens_loaded_from_disk == 64
    engine.flush_connector()
    assert len(half.slots) == 4


def test_a_slot_pinned_by_a_transfer_in_flight_is_kept_until_a_retry(make_engine, tmp_path):
    engine = make_engine(kv_transfer_config=offloading_config(num_cpu_blocks=8, root_dir=str(tmp_path / "tier")),
                         enable_prefix_caching=False)
    half = engine.scheduler.connector
    recorder = half.kv_event_recorder()
    engine.generate([prompt(40, seed=2)], ONE)
    engine.flush_connector()  # these two are unpinned
    engine.generate([prompt(40, seed=3)], ONE)  # ends in the step that stores: its two stores are in flight
    assert engine.stats().cpu_tier == CPUTierUsage(num_slots=8, num_filled=4, num_pinned=2)
    events = recorder.take_events()
    pinned = {k for k in half.slots.keys() if half.slots.lookup(k) in half.job_slots.values()}
    assert half.reset_cache() is False
    assert set(half.slots.keys()) == pinned and len(pinned) == 2
    dropped = [e for e in recorder.take_events() if isinstance(e, BlockRemoved)]
    assert [e.medium for e in dropped] == [MEDIUM_CPU] * 2  # one per dropped entry
    assert not {e.block_hashes[-1] for e in dropped} & {int.from_bytes(k[:-4], "big") & ((1 << 64) - 1)
                                                        for k in pinned}
    engine.flush_connector()  # the stores land (and are announced): their pins go
    events += dropped + recorder.take_events()
    assert half.reset_cache() is True and len(half.slots) == 0
    events += recorder.take_events()

    def cpu(kind):
        return sorted(e.block_hashes[-1] for e in events if isinstance(e, kind) and e.medium == MEDIUM_CPU)

    assert len(cpu(BlockStored)) == 4 and cpu(BlockRemoved) == cpu(BlockStored)  # all announced, all withdrawn
    assert len(half.disk) == 4


def test_reset_forgets_the_store_threshold_counts():
    half = make_half(num_cpu_blocks=8, store_threshold=2)
    replay_kvtool(half, [["a0", "a1"]])
    assert half.reset_cache() is True
    # Offered once before the reset: counted from zero again, stored on the second offer after it.
    assert [r["stored"] for r in replay_kvtool(half, [["a0", "a1"]] * 2)] == [[], ["a0", "a1"]]


def test_reset_restarts_the_offers_of_running_requests():
    """As after vLLM's reset, a running request offers its chunks again from the first."""
    half = make_half(num_cpu_blocks=8)
    replay_kvtool(half, [["a0", "a1"]])
    half.next_store["running"] = 2
    half.reset_cache()
    assert half.next_store == {"running": 0} and not half.accesses and not half.hit_chunks
