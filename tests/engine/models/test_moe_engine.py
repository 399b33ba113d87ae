"""Mixtral and Qwen3-MoE through the whole engine on CPU, float32, against transformers.

For the tiny-mixtral and tiny-qwen3-moe presets (kvtool's writer) and a Qwen3-MoE directory
written by transformers' own save_pretrained: three prompts sharing a 48-token prefix, 64
greedy tokens each, equal transformers' greedy generation with chunked prefill (32 tokens a
step); the prompts again hit the prefix cache and give the same tokens and logprobs; with the
CPU + disk OffloadingConnector, an engine built after the first closed loads the stored KV and
gives the same tokens and logprobs. On CPU the model reports its experts on the plain PyTorch
loop and no CUDA graphs. (Windows that bind: test_sliding_window.py.)
"""

from __future__ import annotations

import pytest
import torch

from kvtool.engine.models import build_model
from kvtool.engine.models.fast_paths import apply_fast_paths
from kvtool.engine.models.model_dir import open_model_dir
from kvtool.engine.presets.catalog import PRESETS, create_model_dir, write_random_model_dir
from tests.support.architecture_checks import (
    greedy_matches_transformers_with_chunks_and_prefix_hits,
    offload_reuse_in_a_new_engine_equals_no_reuse,
)


def _save_pretrained(d) -> None:
    """A Qwen3-MoE directory as transformers writes it (its config form and weight names), with
    kvtool's tokenizer files."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    preset = PRESETS["tiny-qwen3-moe"]
    write_random_model_dir(d, preset.hf_config, seed=5, tokenizer=preset.tokenizer, config_only=True)
    keys = {k: v for k, v in preset.hf_config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**keys, dtype="float32"))
    with torch.no_grad():  # trained-like scales: transformers' init (std 0.02) routes almost uniformly
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    hf.save_pretrained(d)


@pytest.fixture(scope="module", params=["tiny-mixtral", "tiny-qwen3-moe", "qwen3-moe-save-pretrained"])
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / request.param
    if request.param == "qwen3-moe-save-pretrained":
        _save_pretrained(d)
    else:
        create_model_dir(d, preset=request.param, seed=2)
    return d


def test_greedy_tokens_match_transformers_with_chunks_and_prefix_hits(model_dir):
    greedy_matches_transformers_with_chunks_and_prefix_hits(model_dir)


def test_offloading_reuse_in_a_new_engine_equals_no_reuse(model_dir, tmp_path):
    offload_reuse_in_a_new_engine_equals_no_reuse(model_dir, tmp_path)


def test_experts_run_the_plain_loop_without_cuda_graphs(model_dir):
    md = open_model_dir(model_dir)
    paths = apply_fast_paths(build_model(md, "cpu", torch.float32), "cpu", torch.float32)
    assert paths.moe_experts == "torch" and not paths.cuda_graphs and not paths.fused_gate_up
    dense = md.config.num_layers - len(md.config.moe.sparse_layers)
    assert paths.gemm.down_proj == ("torch" if dense == 0 else "mixed") and paths.gemm.qkv == "onednn"
