"""Async scheduling: step N+1 is scheduled and queued before step N's result is read, and the
output is the same as the synchronous engine's (on CPU; tests/cuda checks the device)."""

import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.core.messages import PLACEHOLDER_TOKEN
from kvtool.engine.params import SamplingParams
from tests.support.connectors import dict_connector

PROMPTS = [[(11 * i + 5 * j) % 480 + 2 for j in range(n)] for i, n in enumerate([75, 20, 140, 75, 33, 9, 64, 101])]
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0.0),
    SamplingParams(max_tokens=7, temperature=0.9, seed=3),
    SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[PROMPTS[2][5]]),
    SamplingParams(max_tokens=16, temperature=0.0, logprobs=1),
    SamplingParams(max_tokens=1, temperature=0.0),
    SamplingParams(max_tokens=12, temperature=0.7, top_k=30, seed=9),
    SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.0, stop=["a"]),
]
OFFLOAD = '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"num_cpu_blocks":32}}'


def outputs(results):
    return [(r.output_token_ids, r.finish_reason, r.stop_reason) for r in results]


@pytest.mark.parametrize("setting", ["plain", "preempting", "offloading"])
def test_async_output_equals_sync(make_engine, setting):
    extra = {}
    if setting == "preempting":
        extra = dict(num_gpu_blocks=24, max_num_batched_tokens=48)
    runs = {}
    for mode in (False, True):
        if setting == "offloading":
            extra = dict(kv_transfer_config=parse_kv_transfer_config(OFFLOAD))
        engine = make_engine(async_scheduling=mode, **extra)
        first = engine.generate(PROMPTS, PARAMS)
        engine.reset_prefix_cache()
        second = engine.generate(PROMPTS, PARAMS)  # loads from the tier (offloading), else computes again
        runs[mode] = (outputs(first), outputs(second), engine.stats())
    assert runs[True][0] == runs[False][0] and runs[True][1] == runs[False][1]
    if setting == "preempting":
        assert runs[True][2].num_preemptions > 0
    if setting == "offloading":
        assert runs[True][2].external_tokens_loaded > 0


def test_next_step_is_queued_before_the_previous_result_is_read(make_engine):
    engine = make_engine(async_scheduling=True)
    events = []
    execute_async = engine.executor.execute_async

    def traced(so):
        events.append(("queue", [s.token_ids[0] == PLACEHOLDER_TOKEN for s in so.scheduled]))
        pending = execute_async(so)
        result = pending.result

        def traced_result():
            events.append(("read", None))
            return result()

        pending.result = traced_result
        return pending

    engine.executor.execute_async = traced
    r = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert len(r.output_token_ids) == 6
    kinds = [k for k, _ in events]
    # queue 1, queue 2, read 1, queue 3, read 2, ...: always one step ahead.
    assert kinds[:4] == ["queue", "queue", "read", "queue"]
    # Decode steps take their token from the step still in flight, on the runner's side.
    assert any(flags and all(flags) for k, flags in events if k == "queue")


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_load_failure_under_async_scheduling(make_engine, policy):
    dict_connector.STORE.clear()
    dict_connector.BEFORE_LOAD.clear()
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS[2][:70]

    def config():
        return parse_kv_transfer_config(
            '{"kv_connector":"DictConnector","kv_connector_module_path":"tests.support.connectors.dict_connector",'
            f'"kv_role":"kv_both","kv_load_failure_policy":"{policy}"}}'
        )

    ref = make_engine(kv_transfer_config=config()).generate([prompt], greedy)[0].output_token_ids

    def remove_third(loads):
        if len(loads) >= 3:
            dict_connector.STORE.pop(loads[2].block_hash, None)

    dict_connector.BEFORE_LOAD.append(remove_third)
    try:
        engine = make_engine(async_scheduling=True, kv_transfer_config=config())
        other = [5] * 40
        results = engine.generate([prompt, other], greedy)
        assert results[1].output_token_ids == make_engine().generate([other], greedy)[0].output_token_ids
        if policy == "fail":
            assert results[0].finish_reason == "error" and results[0].output_token_ids == []
        else:
            assert results[0].output_token_ids == ref and results[0].stats.num_external_tokens == 32
    finally:
        dict_connector.STORE.clear()
        dict_connector.BEFORE_LOAD.clear()
