"""MistralForCausalLM (Mistral 7B v0.1-v0.3, Mistral NeMo, ...): Llama's layout.

Mistral 7B v0.1 attends within a sliding window of 4096 tokens; kvtool runs only full attention,
so the engine refuses such a config unless --max-model-len is at most the window (within it the
two are the same). `sliding_window: null` (v0.2 onward) is full attention.
"""

from __future__ import annotations

from kvtool.engine.models.layers import CausalLM
from kvtool.engine.models.llama import LlamaAttention


class MistralForCausalLM(CausalLM):
    attention_cls = LlamaAttention
