"""Qwen2 and Mistral through the whole engine on CPU, float32, against transformers.

For the tiny-qwen2 and tiny-mistral presets and a Qwen2 with yarn RoPE (transformers-5 config
form): three prompts sharing a 48-token prefix, 64 greedy tokens each, must equal
transformers' greedy generation; prefill is chunked (32 tokens a step). The same prompts again
hit the prefix cache and give the same tokens, logprobs included; and with the CPU + disk
OffloadingConnector, an engine built after the first one closed loads the stored KV and gives
the same tokens and logprobs as the first. Mistral's sliding window larger than the engine's
length runs; a smaller one is refused in one line unless --max-model-len fits in it.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.engine import LLMEngine
from kvtool.engine.errors import ConfigError
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.engine.presets.catalog import PRESETS, create_model_dir, write_random_model_dir

NUM_TOKENS = 64
PREFIX = [(i * 37 + 11) % 240 + 5 for i in range(48)]
PROMPTS = [PREFIX + [(i * 13 + k * 7) % 240 + 5 for i in range(n)] for k, n in enumerate((9, 17, 25))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 1000000.0}


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-mistral", "qwen2-yarn-v5"])
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / request.param
    if request.param == "qwen2-yarn-v5":
        cfg = {k: v for k, v in PRESETS["tiny-qwen2"].hf_config.items() if k not in ("rope_theta", "torch_dtype")}
        write_random_model_dir(d, {**cfg, "rope_parameters": YARN, "dtype": "float32"}, seed=4)
    else:
        create_model_dir(d, preset=request.param, seed=2)
    return d


def engine(model_dir, **overrides) -> LLMEngine:
    params = {"model": str(model_dir), "device": "cpu", "kv_cache_memory": 64 << 20, "max_model_len": 1024,
              "max_num_batched_tokens": 32, **overrides}
    return LLMEngine(EngineParams(**params))


def hf_greedy(model_dir, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens with its KV cache, EOS not special (as ignore_eos)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: list[int] = []
    past, feed = None, torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(NUM_TOKENS):
            r = hf(feed, past_key_values=past, use_cache=True)
            past = r.past_key_values
            out.append(int(r.logits[0, -1].argmax()))
            feed = torch.tensor([[out[-1]]])
    return out


def test_greedy_tokens_match_transformers_with_chunks_and_prefix_hits(model_dir):
    e = engine(model_dir)
    try:
        first = e.generate(PROMPTS, GREEDY)
        again = e.generate(PROMPTS, GREEDY)
    finally:
        e.close()
    for prompt, got in zip(PROMPTS, first):
        assert got.output_token_ids == hf_greedy(model_dir, prompt)
    assert all(r.stats.num_cached_tokens >= 48 for r in again)
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in first]
    assert [r.logprobs for r in again] == [r.logprobs for r in first]


def test_offloading_reuse_in_a_new_engine_equals_no_reuse(model_dir, tmp_path):
    ktc = parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"num_cpu_blocks": 64, "root_dir": str(tmp_path / "tier")},
    }))
    filler = engine(model_dir, kv_transfer_config=ktc, enable_prefix_caching=False)
    try:
        without = filler.generate(PROMPTS, GREEDY)
        filler.executor.worker.connector.flush()
    finally:
        filler.close()
    reuser = engine(model_dir, kv_transfer_config=ktc, enable_prefix_caching=False)
    try:
        with_reuse = reuser.generate(PROMPTS, GREEDY)
    finally:
        reuser.close()
    assert all(r.stats.num_external_tokens >= 48 for r in with_reuse)
    assert [r.output_token_ids for r in with_reuse] == [r.output_token_ids for r in without]
    assert [r.logprobs for r in with_reuse] == [r.logprobs for r in without]


def test_mistral_sliding_window(tmp_path):
    d = tmp_path / "windowed"
    write_random_model_dir(d, {**PRESETS["tiny-mistral"].hf_config, "sliding_window": 128}, seed=1,
                           tokenizer=PRESETS["tiny-mistral"].tokenizer)
    with pytest.raises(ConfigError) as e:
        engine(d, max_model_len=None)
    line = str(e.value)
    assert "\n" not in line and "sliding-window attention (sliding_window=128) is not supported yet" in line
    assert "--max-model-len 128 or less" in line
    e = engine(d, max_model_len=128)  # full attention within the window: runs
    try:
        assert len(e.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4))[0].output_token_ids) == 4
    finally:
        e.close()
