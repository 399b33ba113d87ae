"""LlamaForCausalLM (Llama 2/3/3.1, SmolLM2, ...): grouped-query attention with RoPE, over paged KV."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvtool.engine.kernels.attention import attend
from kvtool.engine.models.layers import CausalLM, apply_rotary
from kvtool.engine.models.model_dir import ModelConfig
from kvtool.engine.models.parallel import RowParallelLinear, rank_heads
from kvtool.engine.models.shard_layout import TPRank


class LlamaAttention(nn.Module):
    """Attention over the rank's heads: q/k/v column-parallel (the rank's heads' rows), o_proj
    row-parallel (one all-reduce) at tp.size > 1; the whole model's heads at tp.size 1.
    config.attention_bias gives q/k/v biases, and o_proj one where `o_proj_bias` says so."""

    # Whether o_proj has a bias when config.attention_bias is set (Qwen2: never).
    o_proj_bias = True

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPRank = TPRank()) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        heads = rank_heads(config, tp)
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        # Keys a query sees: those of the last `sliding_window` positions, or all (None).
        self.sliding_window = config.sliding_window
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        o_cls = nn.Linear if tp.size == 1 else RowParallelLinear
        self.o_proj = o_cls(self.num_heads * self.head_dim, config.hidden_size, bias=bias and self.o_proj_bias)
        # fast_forward(self, x, cos, sin): q/k/v as one product, then one norm-and-rotate pass
        # (set by `models.fast_paths.apply_fast_paths`, with that product's weight; Qwen3's too).
        # None runs the forward below.
        self.fast_forward: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; stores this step's K/V in the pages through `attend`."""
        if self.fast_forward is not None:
            return self.fast_forward(self, x, cos, sin)
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(attend(self.layer_idx, q, k, v, self.scale, window=self.sliding_window))


class LlamaForCausalLM(CausalLM):
    attention_cls = LlamaAttention
