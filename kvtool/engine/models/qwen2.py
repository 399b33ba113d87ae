"""Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama's layout with biases on q/k/v and none on o_proj, no
q/k norm; the small sizes tie the LM head to the embedding."""

from __future__ import annotations

from kvtool.engine.models.layers import CausalLM
from kvtool.engine.models.llama import LlamaAttention


class Qwen2Attention(LlamaAttention):
    # config.attention_bias is always set for Qwen2 (model_dir): q/k/v biases only.
    o_proj_bias = False


class Qwen2ForCausalLM(CausalLM):
    attention_cls = Qwen2Attention
