"""Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms), and a
sparse MoE block (`moe.SparseMoeBlock`) as `mlp` (router `mlp.gate`, experts
`mlp.experts.N.gate_proj/up_proj/down_proj`) in the layers config.moe.sparse_layers names; the
others (mlp_only_layers, decoder_sparse_step) keep a dense MLP of intermediate_size.
"""

from __future__ import annotations

from kvtool.engine.models.layers import CausalLM
from kvtool.engine.models.moe import SparseMoeBlock
from kvtool.engine.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(CausalLM):
    attention_cls = Qwen3Attention
    moe_cls = SparseMoeBlock
