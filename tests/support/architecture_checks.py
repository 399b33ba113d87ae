"""What every architecture's engine test checks on CPU, float32, against transformers.

Three prompts sharing a 48-token prefix, 64 greedy tokens each, equal transformers' greedy
generation with chunked prefill (32 tokens a step); the prompts again hit the prefix cache and
give the same tokens and logprobs; and with the CPU + disk OffloadingConnector, an engine built
after the first one closed loads the stored KV and gives the same tokens and logprobs.
"""

from __future__ import annotations

import json

import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.engine import LLMEngine
from kvtool.engine.params import EngineParams, SamplingParams

NUM_TOKENS = 64
PREFIX = [(i * 37 + 11) % 240 + 5 for i in range(48)]
PROMPTS = [PREFIX + [(i * 13 + k * 7) % 240 + 5 for i in range(n)] for k, n in enumerate((9, 17, 25))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)


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


def greedy_matches_transformers_with_chunks_and_prefix_hits(model_dir) -> None:
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


def offload_reuse_in_a_new_engine_equals_no_reuse(model_dir, tmp_path) -> None:
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
