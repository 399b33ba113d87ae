"""Gemma2ForCausalLM and Gemma3ForCausalLM (Gemma 3 text models): Llama's projections with Gemma's
own pieces, as transformers' Gemma2 and Gemma3 text models compute them:

* RMSNorm scaling by (1 + weight), all in float32 before the cast (Llama casts, then scales);
  four per layer (before and after attention, before and after the MLP) and, in Gemma 3, one
  per head of q and k before RoPE;
* the embedding multiplied by sqrt(hidden_size), rounded to the weights' dtype first;
* a GeGLU MLP (gelu with the tanh approximation);
* attention scaled by query_pre_attn_scalar ** -0.5; local layers (config.gemma.sliding_layers:
  every other one in Gemma 2, five in six in Gemma 3) attend within config.sliding_window; in
  Gemma 3 they rotate with their own RoPE (rope_local_base_freq, 10000), the global ones with
  rope_theta and its scaling;
* Gemma 2's attention scores soft-capped (tanh(s / 50) * 50) before the mask, and its logits
  (tanh(l / 30) * 30); Gemma 3 leaves both unset.

On CPU the model runs these modules' own forwards (`CausalLM.fused_forwards` off: `cpu_fused`
is written for Llama's norms and SiLU MLP). On CUDA (bf16/fp16) `fused_ops` gives each module a
fused forward through its `fast_forward` field, as it does Llama's (`CausalLM.cuda_fused_forwards`):
Gemma's norm kernels (the residual adds inside them), q/k norms and RoPE in the rope kernel, the
gate/up GEMM and a GeGLU kernel, every projection through `row_invariant_gemm`, and attention
with the layer's window and soft cap in the CUDA kernels; so decode steps replay from CUDA
graphs and batch invariance holds as for the other architectures. The local layers' keys all stay
in the KV pages; the attention masks those outside the window.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from kvtool.engine.kernels.attention import ROW_MULTIPLE, attend
from kvtool.engine.models.layers import CausalLM, GatedMLP, RotaryEmbedding, apply_rotary, make_embedding, pad_rows_on_cpu
from kvtool.engine.models.llama import LlamaAttention
from kvtool.engine.models.model_dir import ModelConfig
from kvtool.engine.models.shard_layout import TPRank


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), in float32, then cast to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        # fast_forward(self, x): a fused norm (set by `fast_paths.apply_fast_paths` on CUDA); None
        # runs the one below.
        self.fast_forward: Callable[[GemmaRMSNorm, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_forward is not None:
            return self.fast_forward(self, x)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(LlamaAttention):
    """Gemma 3's q/k normalised per head (Gemma's norm), then rotated; the local layers' window;
    Gemma 2's soft-capped scores."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPRank = TPRank()) -> None:
        super().__init__(config, layer_idx, tp)
        gemma = config.gemma
        self.scale = gemma.query_pre_attn_scalar**-0.5
        self.local = layer_idx in gemma.sliding_layers
        self.sliding_window = config.sliding_window if self.local else None
        self.softcap = gemma.attn_logit_softcapping
        if gemma.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.fast_forward is not None:  # LlamaAttention's field
            return self.fast_forward(self, x, cos, sin)
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if "q_norm" in self._modules:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(self.layer_idx, q, k, v, self.scale, window=self.sliding_window, softcap=self.softcap)
        return self.o_proj(out)


class GegluMLP(GatedMLP):
    """gelu(gate, tanh approximation) * up, then down (GatedMLP's layout and sharding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_forward is not None:  # GatedMLP's field
            return self.fast_forward(self, x)
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: GemmaAttention, tp: TPRank) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = attention
        self.mlp = GegluMLP(config.hidden_size, config.intermediate_size, tp)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    """Scaled embedding, layers, final norm; a RoPE for the global layers and one for the local."""

    def __init__(self, config: ModelConfig, attention_cls: type[GemmaAttention], tp: TPRank = TPRank(),
                 moe_cls: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config, tp)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, attention_cls(config, i, tp), tp) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # Gemma 3's local layers rotate by their own RoPE; Gemma 2's by the global one (None).
        gemma = config.gemma
        local = msgspec.structs.replace(config, rope_theta=gemma.local_rope_theta, rope_scaling=gemma.local_rope_scaling)
        self.local_rotary_emb = RotaryEmbedding(local) if local != config else None
        self.embed_scale = config.hidden_size**0.5
        self.few_rows_multiple = ROW_MULTIPLE  # the runner and `compute_logits` read it
        # fast_forward(self, input_ids, positions, rows): the fused decoder loop (set by
        # `fast_paths.apply_fast_paths` on CUDA); None runs the one below.
        self.fast_forward: Callable[..., torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] -> final-normed hidden states [T, hidden], or with `rows`
        ([S] long) those rows only, [S, hidden]."""
        if self.fast_forward is not None:
            return self.fast_forward(self, input_ids, positions, rows)
        n = input_ids.shape[0]
        input_ids, positions = pad_rows_on_cpu(input_ids, self.few_rows_multiple), pad_rows_on_cpu(positions, self.few_rows_multiple)
        h = self.embed_tokens(input_ids)
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        rope = {False: self.rotary_emb(positions, h.dtype)}
        rope[True] = rope[False] if self.local_rotary_emb is None else self.local_rotary_emb(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, *rope[layer.self_attn.local])
        h = self.norm(h[:n])
        return h if rows is None else h.index_select(0, rows)


class Gemma3ForCausalLM(CausalLM):
    attention_cls = GemmaAttention
    decoder_cls = GemmaModel
    # `cpu_fused` is written for Llama's modules; `fused_ops` covers these too (`CausalLM`).
    fused_forwards = False

    def compute_logits(self, hidden: torch.Tensor, as_float: bool = True, row_invariant: bool = False) -> torch.Tensor:
        """`CausalLM.compute_logits`, soft-capped where the config says (Gemma 2). Capped logits
        are float32 whatever `as_float` asks: capped in half precision, the top logits of a row
        (tanh flattens them toward the cap) would round to ties that a decode graph's argmax
        breaks otherwise than the float32 ones."""
        cap = self.config.gemma.final_logit_softcapping
        if cap is None:
            return super().compute_logits(hidden, as_float, row_invariant)
        logits = super().compute_logits(hidden, True, row_invariant)
        return torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's layout without q/k norms, one RoPE, soft-capped scores and logits (the
    config says which: `GemmaConfig`)."""
