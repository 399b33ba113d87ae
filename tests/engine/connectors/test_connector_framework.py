"""The connector framework end to end with a test-only dict connector (tests/support/connectors/dict_connector.py)."""

import msgspec
import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.errors import ConfigError
from kvtool.engine.kv.pages import KVGeometry
from kvtool.engine.params import SamplingParams
from tests.support.connectors import dict_connector

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [(i * 7 + 3) % 250 + 3 for i in range(70)]  # 4 full blocks of 16 + 6 tokens


def dict_config(role="kv_both", policy="fail"):
    return parse_kv_transfer_config(
        '{"kv_connector":"DictConnector","kv_connector_module_path":"tests.support.connectors.dict_connector",'
        f'"kv_role":"{role}","kv_load_failure_policy":"{policy}"}}'
    )


@pytest.fixture(autouse=True)
def clean_store():
    dict_connector.STORE.clear()
    dict_connector.BEFORE_LOAD.clear()
    dict_connector.CALLS.clear()
    yield
    dict_connector.STORE.clear()
    dict_connector.BEFORE_LOAD.clear()


def test_second_run_loads_all_full_blocks(make_engine):
    ref = make_engine().generate([PROMPT], GREEDY)[0]
    writer = make_engine(kv_transfer_config=dict_config())
    first = writer.generate([PROMPT], GREEDY)[0]
    assert first.stats.num_external_tokens == 0
    assert first.stats.num_external_stored_tokens == 64
    assert len(dict_connector.STORE) == 4
    # A fresh engine (empty prefix cache) loads every full block through the connector.
    reader = make_engine(kv_transfer_config=dict_config())
    second = reader.generate([PROMPT], GREEDY)[0]
    assert second.stats.num_cached_tokens == 0
    assert second.stats.num_external_tokens == 64
    assert second.stats.num_external_loaded_tokens == 64
    assert second.output_token_ids == first.output_token_ids == ref.output_token_ids
    stats = reader.stats()
    assert stats.external_tokens_loaded == 64 and stats.bytes_loaded > 0


def test_call_order_matches_vllm(make_engine):
    engine = make_engine(kv_transfer_config=dict_config())
    engine.generate([PROMPT], GREEDY)
    calls = dict_connector.CALLS
    first_step = calls[: calls.index("wait_for_save") + 1]
    assert first_step == [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "start_load_kv",
        "wait_for_save",
    ]
    # The request finishes in update_from_output, after the worker reported the step.
    assert calls[-2:] == ["wait_for_save", "request_finished"]


def test_producer_never_loads_consumer_never_stores(make_engine):
    make_engine(kv_transfer_config=dict_config("kv_producer")).generate([PROMPT], GREEDY)
    assert len(dict_connector.STORE) == 4
    again = make_engine(kv_transfer_config=dict_config("kv_producer")).generate([PROMPT], GREEDY)[0]
    assert again.stats.num_external_tokens == 0
    dict_connector.STORE.clear()
    consumer = make_engine(kv_transfer_config=dict_config("kv_consumer"))
    consumer.generate([PROMPT], GREEDY)
    assert dict_connector.STORE == {}


def _fill(make_engine):
    make_engine(kv_transfer_config=dict_config()).generate([PROMPT], GREEDY)
    return make_engine().generate([PROMPT], GREEDY)[0].output_token_ids


def test_geometry_mismatch_is_refused(make_engine):
    ref = _fill(make_engine)
    for h, (g, data) in list(dict_connector.STORE.items()):
        dict_connector.STORE[h] = (msgspec.structs.replace(g, num_layers=g.num_layers + 1), data)
    failing = make_engine(kv_transfer_config=dict_config(policy="fail")).generate([PROMPT], GREEDY)[0]
    assert failing.finish_reason == "error"
    assert "KV geometry mismatch on num_layers" in failing.error
    assert failing.output_token_ids == []
    recomputing = make_engine(kv_transfer_config=dict_config(policy="recompute")).generate([PROMPT], GREEDY)[0]
    assert recomputing.finish_reason == "length" and recomputing.output_token_ids == ref


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_block_removed_between_lookup_and_load(make_engine, policy):
    ref = _fill(make_engine)
    # Remove the third block after the scheduler counted it and before the worker loads it.

    def remove_third(loads):
        if len(loads) >= 3:
            dict_connector.STORE.pop(loads[2].block_hash, None)

    dict_connector.BEFORE_LOAD.append(remove_third)
    engine = make_engine(kv_transfer_config=dict_config(policy=policy))
    other = [5] * 40
    results = engine.generate([PROMPT, other], GREEDY)
    ref_other = make_engine().generate([other], GREEDY)[0]
    assert results[1].output_token_ids == ref_other.output_token_ids  # the batch is unaffected
    r = results[0]
    if policy == "fail":
        assert r.finish_reason == "error" and "gone from the store" in r.error and r.output_token_ids == []
        # Nothing half-loaded was cached: the same engine now loads the two blocks still stored.
        dict_connector.BEFORE_LOAD.clear()
        again = engine.generate([PROMPT], GREEDY)[0]
        assert again.output_token_ids == ref
        assert again.stats.num_cached_tokens == 0 and again.stats.num_external_tokens == 32
    else:
        assert r.output_token_ids == ref
        assert r.stats.num_external_tokens == 32  # two good blocks kept, the rest recomputed
    assert engine.stats().load_failures == 1


def test_refusal_guard_stops_scheduler_only_connector(make_engine, monkeypatch):
    import kvtool.engine.models as models

    built = []
    monkeypatch.setattr(models, "build_model", lambda *a, **k: built.append(1))
    cfg = parse_kv_transfer_config(
        '{"kv_connector":"SchedulerOnlyConnector","kv_connector_module_path":"tests.support.connectors.dict_connector",'
        '"kv_role":"kv_both"}'
    )
    with pytest.raises(ConfigError) as e:
        make_engine(kv_transfer_config=cfg)
    msg = str(e.value)
    assert "'SchedulerOnlyConnector' cannot run on device cpu" in msg
    assert "no worker half" in msg and "skip prefill" in msg
    assert "OffloadingConnector" in msg
    assert built == []  # refused before any model was built or run


def test_unknown_module_path_is_a_config_error(make_engine):
    cfg = parse_kv_transfer_config(
        '{"kv_connector":"Nope","kv_connector_module_path":"tests.support.connectors.dict_connector","kv_role":"kv_both"}'
    )
    with pytest.raises(ConfigError, match="is not a kvtool KVConnector"):
        make_engine(kv_transfer_config=cfg)


def test_geometry_struct_describe():
    g = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, block_size=16, dtype="float32")
    assert g.bytes_per_block == 2 * 2 * 1 * 4 * 4 * 16
