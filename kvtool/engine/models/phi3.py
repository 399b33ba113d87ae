"""Phi3ForCausalLM (Phi-3-mini, Phi-3-medium): Llama's decoder, with q/k/v stored as one
`qkv_proj` and gate/up as one `gate_up_proj` per layer in the checkpoint.

The model keeps Llama's separate projections, so every fast path and tensor-parallel split of a
Llama applies unchanged; the loader splits the stored tensors into them (`packed_modules`), and
under tensor parallelism reads the rank's rows of each part, as vLLM's QKVParallelLinear and
MergedColumnParallelLinear shard them. No biases; RMSNorm, SiLU MLP, RoPE over the whole head.
The configs' sliding window and long-context RoPE are checked in model_dir.py and engine.py.
"""

from __future__ import annotations

from kvtool.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
