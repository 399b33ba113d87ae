"""Qwen2 and Mistral through the whole engine on CPU, float32, against transformers.

For the tiny-qwen2 and tiny-mistral presets and a Qwen2 with yarn RoPE (transformers-5 config
form): three prompts sharing a 48-token prefix, 64 greedy tokens each, must equal
transformers' greedy generation; prefill is chunked (32 tokens a step). The same prompts again
hit the prefix cache and give the same tokens, logprobs included; and with the CPU + disk
OffloadingConnector, an engine built after the first one closed loads the stored KV and gives
the same tokens and logprobs as the first. (Windows that bind: test_sliding_window.py.)
"""

from __future__ import annotations

import pytest

from kvtool.engine.presets.catalog import PRESETS, create_model_dir, write_random_model_dir
from tests.support.architecture_checks import (
    greedy_matches_transformers_with_chunks_and_prefix_hits,
    offload_reuse_in_a_new_engine_equals_no_reuse,
)

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


def test_greedy_tokens_match_transformers_with_chunks_and_prefix_hits(model_dir):
    greedy_matches_transformers_with_chunks_and_prefix_hits(model_dir)


def test_offloading_reuse_in_a_new_engine_equals_no_reuse(model_dir, tmp_path):
    offload_reuse_in_a_new_engine_equals_no_reuse(model_dir, tmp_path)
