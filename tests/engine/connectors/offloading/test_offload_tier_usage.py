"""The CPU tier's usage in the engine's stats: what `vllm:kv_offload_cpu_cache_usage_perc` reads."""

import json

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.outputs import CPUTierUsage
from kvtool.engine.params import SamplingParams


def _config(**extra) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra})


def _prompt(n: int, seed: int) -> list[int]:
    return [(i * 31 + seed * 17) % 240 + 5 for i in range(n)]


def test_stats_count_filled_and_pinned_slots(make_engine, tmp_path):
    engine = make_engine(kv_transfer_config=parse_kv_transfer_config(_config(root_dir=str(tmp_path / "tier"),
                                                                             num_cpu_blocks=6)))
    assert engine.stats().cpu_tier == CPUTierUsage(num_slots=6, num_filled=0, num_pinned=0)
    one = SamplingParams(max_tokens=1, temperature=0.0)  # ends in the step that stores: its jobs are still in flight
    assert engine.generate([_prompt(70, seed=1)], one)[0].stats.num_external_stored_tokens == 64
    assert engine.stats().cpu_tier == CPUTierUsage(num_slots=6, num_filled=4, num_pinned=4)
    engine.flush_connector()  # the stores are reported done: their pins go, their blocks stay
    assert engine.stats().cpu_tier == CPUTierUsage(num_slots=6, num_filled=4, num_pinned=0)
    engine.generate([_prompt(70, seed=2)], one)
    engine.flush_connector()
    assert engine.stats().cpu_tier == CPUTierUsage(num_slots=6, num_filled=6, num_pinned=0)  # two evicted for four


def test_no_connector_reports_no_cpu_tier(make_engine):
    assert make_engine().stats().cpu_tier is None
