"""vLLM 0.33's OffloadingConnector keys on a running engine: their effect, and output identical to
an engine without a connector."""

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.offloading.disk.tier_report import scan
from kvtool.engine.events.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockStored
from kvtool.engine.outputs import CPUTierUsage
from kvtool.engine.params import SamplingParams
from tests.support.offload_replay import offloading_config, prompt

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
    assert engine.scheduler.connector.obt == 64 and engine.executor.worker.connector.pool.blocks_per_slot == 4
    first = run(engine, p, GREEDY)
    assert first.stats.num_external_stored_tokens == 128  # two whole 64-token blocks of 150 tokens
    second = run(engine, p, GREEDY)
    assert second.stats.num_external_tokens == 128
    assert first.output_token_ids == second.output_token_ids == ref.output_token_ids


def test_tiering_spec_fs_tier_writes_kvtool_disk_files_a_fresh_engine_loads(make_engine, tmp_path):
    root = tmp_path / "fs-tier"
    config = offloading_config(spec_name="TieringOffloadingSpec", cpu_bytes_to_use="64M",
                 secondary_tiers=[{"type": "fs", "root_dir": str(root)}])
    prompts = [prompt(80, seed=5), prompt(300, seed=6)]
    ref = make_engine().generate(prompts, GREEDY)
    writer = make_engine(kv_transfer_config=config)
    written = writer.generate(prompts, GREEDY)
    writer.executor.worker.connector.flush()
    report = scan(root, verify=True)
    assert not report.has_damage and len(report.groups) == 1  # one identity: this engine's
    assert report.groups[0].num_blocks == 80 // 16 + 300 // 16
    assert all(f.name.endswith(".kvb") for f in (root / "kv").rglob("*") if f.is_file() and f.name != ".ledger")
    reader = make_engine(kv_transfer_config=config)
    loaded = reader.generate(prompts, GREEDY)
    assert [r.stats.num_external_tokens for r in loaded] == [79, 288]
    assert [r.output_token_ids for r in loaded] == [r.output_token_ids for r in written] == [
        r.output_token_ids for r in ref]


def test_vllms_documented_configs_run(make_engine, tmp_path):
    """The two configurations vLLM's documentation gives (the tiered one with a smaller CPU tier
    here; its 10 GiB is accepted at parse time, tests/engine/connectors/offloading/test_offloading_vllm_keys.py)."""
    docs = [
        '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
        '{"cpu_bytes_to_use":1000000000,"block_size":64,"eviction_policy":"arc"}}',
        '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
        '{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":10737418240,'
        f'"secondary_tiers":[{{"type":"fs","root_dir":"{tmp_path / "tier"}"}}]}}}}',
    ]
    p = prompt(200, seed=7)
    ref = make_engine().generate([p], GREEDY)[0]
    for doc in docs:
        config = parse_kv_transfer_config(doc)
        if "10737418240" in doc:
            config.kv_connector_extra_config["cpu_bytes_to_use"] = 64 << 20
        engine = make_engine(kv_transfer_config=config, enable_prefix_caching=False)
        unit = engine.scheduler.connector.obt
        first, second = run(engine, p, GREEDY), run(engine, p, GREEDY)
        assert second.stats.num_external_tokens == 200 // unit * unit
        assert first.output_token_ids == second.output_token_ids == ref.output_token_ids
    assert list((tmp_path / "tier" / "kv").iterdir())


def test_fs_tier_publishes_storage_events_only_with_enable_kv_events(make_engine, tmp_path):
    """As vLLM's fs tier: no STORAGE events unless enable_kv_events, then carrying its locality."""
    seen = {}
    for enable in (False, True):
        tier = {"type": "fs", "root_dir": str(tmp_path / f"tier-{enable}"), "enable_kv_events": enable,
                "locality": "LOCAL"}
        engine = make_engine(kv_transfer_config=offloading_config(spec_name="TieringOffloadingSpec", num_cpu_blocks=8,
                                                    secondary_tiers=[tier]))
        recorder = engine.scheduler.connector.kv_event_recorder()
        run(engine, prompt(40, seed=8))
        stored = [e for e in recorder.take_events() if isinstance(e, BlockStored)]
        seen[enable] = sorted({(e.medium, e.locality) for e in stored}, key=str)
        assert engine.scheduler.connector.disk is not None and len(engine.scheduler.connector.disk) == 2
    assert seen == {False: [(MEDIUM_CPU, None)], True: [(MEDIUM_CPU, None), (MEDIUM_STORAGE, "LOCAL")]}
