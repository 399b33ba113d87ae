"""vLLM 0.33's OffloadingConnector keys on a running engine: their effect, and output identical to
an engine without a connector."""

from kvtool.engine.outputs import CPUTierUsage
from kvtool.engine.params import SamplingParams
from tests.unit.offload_replay import offloading_config, prompt

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def run(engine, p, params=ONE):
    """One request, then its stores reported (their slots unpinned) before the next."""
    out = engine.generate([p], params)[0]
    engine.flush_connector()
    return out


def test_arc_keeps_a_reused_chunk_through_a_scan_that_lru_evicts_it_with(make_engine):
    """Four CPU slots; chunk A is stored and reused, then five one-time prompts pass. LRU evicts A
    (reused, then least recent); ARC keeps it in its frequent list and still hits it."""
    hot, ref = prompt(17), make_engine().generate([prompt(17)], ONE)[0]
    scan_prompts = [prompt(17, seed) for seed in range(1, 6)]
    last_hit = {}
    for policy in ("lru", "arc"):
        engine = make_engine(kv_transfer_config=offloading_config(num_cpu_blocks=4, eviction_policy=policy),
                             enable_prefix_caching=False)
        assert run(engine, hot).stats.num_external_stored_tokens == 16
        assert run(engine, hot).stats.num_external_tokens == 16
        for p in scan_prompts:
            assert run(engine, p).stats.num_external_stored_tokens == 16
        last = run(engine, hot)
        assert last.output_token_ids == ref.output_token_ids
        last_hit[policy] = last.stats.num_external_tokens
        assert engine.stats().cpu_tier == CPUTierUsage(num_slots=4, num_filled=4, num_pinned=0)
    assert last_hit == {"lru": 0, "arc": 16}


def test_store_threshold_two_stores_a_chunk_on_its_second_offer(make_engine):
    p = prompt(70, seed=3)
    ref = make_engine().generate([p], GREEDY)[0]
    engine = make_engine(kv_transfer_config=offloading_config(num_cpu_blocks=8, store_threshold=2),
                         enable_prefix_caching=False)
    first = run(engine, p, GREEDY)
    assert first.stats.num_external_stored_tokens == 0
    assert engine.stats().cpu_tier == CPUTierUsage(num_slots=8, num_filled=0, num_pinned=0)
    second = run(engine, p, GREEDY)
    assert second.stats.num_external_tokens == 0 and second.stats.num_external_stored_tokens == 64
    assert engine.stats().cpu_tier.num_filled == 4
    third = run(engine, p, GREEDY)
    assert third.stats.num_external_tokens == 64
    assert first.output_token_ids == second.output_token_ids == third.output_token_ids == ref.output_token_ids


def test_blocks_per_chunk_four_gives_64_token_offload_blocks(make_engine):
    p = prompt(150, seed=4)
    ref = make_engine().generate([p], GREEDY)[0]
    engine = make_engine(kv_transfer_config=offloading_config(num_cpu_blocks=4, blocks_per_chunk=4),
                         enable_prefix_caching=False)
    assert engine.scheduler_connector.obt == 64 and engine.worker_connector.pool.blocks_per_slot == 4
    first = run(engine, p, GREEDY)
    assert first.stats.num_external_stored_tokens == 128  # two whole 64-token blocks of 150 tokens
    second = run(engine, p, GREEDY)
    assert second.stats.num_external_tokens == 128
    assert first.output_token_ids == second.output_token_ids == ref.output_token_ids
