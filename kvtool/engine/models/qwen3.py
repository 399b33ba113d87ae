"""Qwen3ForCausalLM: Llama's layout plus an RMSNorm over each head of q and k before RoPE.

Its head_dim is set by config (128 in the public models) rather than hidden_size / num_heads, so
q_proj may widen the hidden state (Qwen3-0.6B: 1024 -> 16 x 128).
"""

from __future__ import annotations

import torch

from kvtool.engine.kernels.attention import attend
from kvtool.engine.models.layers import CausalLM, RMSNorm, apply_rotary
from kvtool.engine.models.llama import LlamaAttention
from kvtool.engine.models.model_dir import ModelConfig
from kvtool.engine.models.shard_layout import TPRank


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPRank = TPRank()) -> None:
        super().__init__(config, layer_idx, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; q/k are normalised per head, then rotated."""
        if self.fast_forward is not None:  # LlamaAttention's field
            return self.fast_forward(self, x, cos, sin)
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(attend(self.layer_idx, q, k, v, self.scale, window=self.sliding_window))


class Qwen3ForCausalLM(CausalLM):
    attention_cls = Qwen3Attention
