"""MistralForCausalLM (Mistral 7B v0.1-v0.3, Mistral NeMo, ...): Llama's layout.

Mistral 7B v0.1 attends within a sliding window of 4096 tokens: every layer's attention masks the
keys behind it, and where the window binds (a --max-model-len past it) the engine's KV cache is,
where the engine keeps groups (`kv.cache_size.kv_cache_layout`), one sliding-window group that
frees the blocks behind it (`kv.groups`). `sliding_window: null`
(v0.2 onward) is full attention.
"""

from __future__ import annotations

from kvtool.engine.models.layers import CausalLM
from kvtool.engine.models.llama import LlamaAttention


class MistralForCausalLM(CausalLM):
    attention_cls = LlamaAttention
