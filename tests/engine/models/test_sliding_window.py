"""Sliding-window attention on CPU: Mistral, Mixtral, Phi-3, Gemma 2 (soft caps too) and Gemma 3 (local
layers only) configs
whose window binds (24 to 40 positions, against prompts of 57 to 73 tokens and 64 generated),
through the whole engine, float32, against transformers (which applies the same window).

For each: three prompts sharing a 48-token prefix, 64 greedy tokens each, equal transformers'
greedy generation with chunked prefill (32 tokens a step); the prompts again hit the prefix cache
and give the same tokens and logprobs; with the CPU + disk OffloadingConnector, an engine built
after the first closed loads the stored KV and gives the same tokens and logprobs. The keys
outside the window stay in the pages (every layer keeps its whole context); the attention masks
them. The per-position logits of windowed configs, with every CPU product, are in
test_logits_vs_hf.py; Gemma on CUDA is in test_gemma_cuda.py.
"""

from __future__ import annotations

import pytest

from kvtool.engine.models.model_dir import open_model_dir
from kvtool.engine.presets.catalog import PRESETS, write_random_model_dir
from tests.support.architecture_checks import (
    greedy_matches_transformers_with_chunks_and_prefix_hits,
    offload_reuse_in_a_new_engine_equals_no_reuse,
)

WINDOWS = {"tiny-mistral": 40, "tiny-mixtral": 32, "phi-3-tiny": 24, "tiny-gemma3": 32, "tiny-gemma2": 24}


@pytest.fixture(scope="module", params=sorted(WINDOWS))
def model_dir(request, tmp_path_factory):
    preset = PRESETS[request.param]
    d = tmp_path_factory.mktemp("models") / request.param
    write_random_model_dir(d, {**preset.hf_config, "sliding_window": WINDOWS[request.param]}, seed=3,
                           tokenizer=preset.tokenizer)
    assert open_model_dir(d).config.sliding_window == WINDOWS[request.param]
    return d


def test_greedy_tokens_match_transformers_with_chunks_and_prefix_hits(model_dir):
    greedy_matches_transformers_with_chunks_and_prefix_hits(model_dir)


def test_offloading_reuse_in_a_new_engine_equals_no_reuse(model_dir, tmp_path):
    offload_reuse_in_a_new_engine_equals_no_reuse(model_dir, tmp_path)
