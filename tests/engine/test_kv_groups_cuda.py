"""KV cache groups on CUDA (Gemma 3, Gemma 2, a windowed Mistral; bf16, window 32): the groups'
block tables through the CUDA kernels, the decode graphs and the one-token prefill graphs give
the bits of a cache that keeps every token in one full-attention group, batched and alone, with
prefix hits; and the OffloadingConnector stores and reloads every group on CUDA, whole blocks and
layerwise (a slot of every block at a time), from the CPU tier and from disk, and LMCache's connector
in its blake3 key mode through an lm:// store, with those bits.
Skipped without CUDA.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.engine import LLMEngine
from kvtool.engine.params import EngineParams, SamplingParams
from tests.support.window_models import WINDOW_PRESETS, window_model_dir

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
PREFIX = [(i * 37 + 11) % 240 + 5 for i in range(80)]
PROMPTS = [PREFIX + [(i * 13 + k * 7) % 240 + 5 for i in range(n)] for k, n in enumerate((9, 30, 57))]
LONG = [(i * 29 + 3) % 240 + 5 for i in range(600)]
DICT_CONNECTOR = json.dumps({"kv_connector": "DictConnector", "kv_role": "kv_both",
                             "kv_connector_module_path": "tests.support.connectors.dict_connector"})


@pytest.fixture(scope="module", params=WINDOW_PRESETS)
def model_dir(request, tmp_path_factory):
    return window_model_dir(tmp_path_factory.mktemp("cuda-groups"), request.param, 32)


def _engine(model_dir, ktc: str | None = None, **overrides) -> LLMEngine:
    params = {"model": str(model_dir), "device": "cuda", "dtype": "bfloat16", "num_gpu_blocks": 600,
              "max_model_len": 1024, "block_size": BS, "batch_invariant": True, **overrides}
    if ktc is not None:
        params["kv_transfer_config"] = parse_kv_transfer_config(ktc)
    return LLMEngine(EngineParams(**params))


def _outputs(results) -> list:
    return [(r.output_token_ids, r.logprobs) for r in results]


@pytest.fixture(scope="module")
def reference(model_dir):
    """Every prompt batched, and each alone, in a cache that keeps every token in one
    full-attention group (the windows as masks), no prefix cache: the bits every grouped run must give."""
    engine = _engine(model_dir, disable_hybrid_kv_cache_manager=True, enable_prefix_caching=False)
    if engine.kv_layout.hybrid:  # the windowed Mistral keeps its window group; a one-group connector does not
        engine.close()
        engine = _engine(model_dir, DICT_CONNECTOR, enable_prefix_caching=False)
    try:
        assert not engine.kv_layout.hybrid
        prompts = PROMPTS + [LONG]
        batched = _outputs(engine.generate(prompts, GREEDY))
        assert [_outputs(engine.generate([p], GREEDY))[0] for p in prompts] == batched
        return batched
    finally:
        engine.close()


def test_groups_run_the_graphs_and_give_the_one_group_bits(model_dir, reference):
    """The model's groups on CUDA: batched with the decode graphs, then each prompt again alone
    (prefix hits in every group, the last prompt token of a whole-block prompt through the
    one-token prefill graphs): the reference's tokens and logprobs."""
    prompts = PROMPTS + [LONG]
    engine = _engine(model_dir)
    try:
        assert engine.kv_layout.hybrid
        runner = engine.executor.worker.runner
        assert runner.backend == "cuda" and runner.graphs is not None
        assert _outputs(engine.generate(prompts, GREEDY)) == reference
        assert sum(runner.graphs.replays.values()) > 0
        again = engine.generate(prompts, GREEDY)
        assert _outputs(again) == reference
        assert all(r.stats.num_cached_tokens > 0 for r in again)
        whole = PREFIX[:64] + PREFIX[:33]  # 97 tokens: 96 cached, the last one computed alone
        replays = runner.prefill_graphs.replays
        cold = _outputs(engine.generate([whole], GREEDY))
        hit = engine.generate([whole], GREEDY)
        assert hit[0].stats.num_cached_tokens == 96 and runner.prefill_graphs.replays > replays
        assert _outputs(hit) == cold
    finally:
        engine.close()


def _offload(root, **extra) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"num_cpu_blocks": 256, "offload_block_tokens": BS,
                                                     "root_dir": str(root), **extra}})


@pytest.mark.parametrize("layerwise", [False, True])
def test_every_group_offloads_and_reloads_on_cuda(model_dir, reference, tmp_path, monkeypatch, layerwise):
    """CPU-tier hits in one engine, then disk hits in a new engine, with the device prefix cache
    off: the reference bits; with `layerwise`, loads wait and saves go one slot of every block at
    a time (every slot saved once per layerwise save)."""
    from kvtool.engine.connectors.offloading.copy.transfers import SlotTransfers

    saved_slots: list[int] = []
    store_layer = SlotTransfers.store_layer

    def record(self, pairs, index, slot):
        saved_slots.append(slot)
        return store_layer(self, pairs, index, slot)

    monkeypatch.setattr(SlotTransfers, "store_layer", record)
    prompts = PROMPTS + [LONG]
    ktc = _offload(tmp_path / "tier", layerwise=layerwise)
    engine = _engine(model_dir, ktc, enable_prefix_caching=False)
    try:
        assert engine.kv_layout.hybrid
        num_slots = engine.kv_layout.num_slots
        assert _outputs(engine.generate(prompts, GREEDY)) == reference
        engine.executor.worker.connector.flush()
        again = engine.generate(prompts, GREEDY)
        engine.executor.worker.connector.flush()
    finally:
        engine.close()
    assert _outputs(again) == reference
    assert all(r.stats.num_external_tokens > 0 for r in again)
    if layerwise:
        assert saved_slots and len(saved_slots) % num_slots == 0
        assert saved_slots == list(range(num_slots)) * (len(saved_slots) // num_slots)
    else:
        assert not saved_slots
    restarted = _engine(model_dir, ktc, enable_prefix_caching=False)
    try:
        from_disk = restarted.generate(prompts, GREEDY)
        assert restarted.stats().external_tokens_loaded_from_disk > 0
    finally:
        restarted.close()
    assert _outputs(from_disk) == reference


def test_lmcache_stores_and_loads_every_group_on_cuda(model_dir, reference):
    """LMCache's connector in kvtool's blake3 key mode keeps the model's groups on CUDA: a
    second engine on the same lm:// store loads every prompt's chunks of every group and gives
    the reference bits. (The store is tests/support/memory_lm_server.py, which speaks LMCache's
    protocol: LMCache's own server is not installed on the GPU machine.)"""
    from tests.support.port_process import port_process

    prompts = PROMPTS + [LONG]
    with port_process("memory_lm_server.py") as port:
        ktc = json.dumps({"kv_connector": "LMCacheConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
                          "kv_connector_extra_config": {"host": "127.0.0.1", "port": port}})
        writer = _engine(model_dir, ktc, enable_prefix_caching=False)
        try:
            assert writer.kv_layout.hybrid
            assert _outputs(writer.generate(prompts, GREEDY)) == reference
            writer.executor.worker.connector.flush()
        finally:
            writer.close()
        reader = _engine(model_dir, ktc, enable_prefix_caching=False)
        try:
            loaded = reader.generate(prompts, GREEDY)
        finally:
            reader.close()
    assert _outputs(loaded) == reference
    assert all(r.stats.num_external_tokens > 0 for r in loaded)
