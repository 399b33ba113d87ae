"""MixtralForCausalLM (Mixtral 8x7B, 8x22B): Mistral's attention, and in every layer a sparse MoE
block (`moe.SparseMoeBlock`) stored as `block_sparse_moe`: router `gate`, experts `experts.N`
with w1 (gate), w3 (up) and w2 (down).

Its configs carry `sliding_window: null` (full attention); a config with a window attends and
caches as Mistral's does.
"""

from __future__ import annotations

from kvtool.engine.models.layers import CausalLM
from kvtool.engine.models.llama import LlamaAttention
from kvtool.engine.models.moe import SparseMoeBlock


class MixtralForCausalLM(CausalLM):
    attention_cls = LlamaAttention
    moe_cls = SparseMoeBlock
