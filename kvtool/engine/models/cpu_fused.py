"""Fused forwards for a model on CPU: one GEMM for q/k/v and one for gate/up, an RMSNorm of two
passes (one 2-norm reduction, one scaling), and one norm and one rotation for q and k together.

`fuse_cpu_modules(model)` (called by `fast_paths.apply_fast_paths` alone) sets the modules'
`fast_forward` / `fast_forward_rows` / `logits_product` fields to the forwards below and gives
each fused module its products, every one a `cpu_gemm.CpuLinear`:

    LlamaAttention  qkv_linear (q/k/v concatenated), o_linear (o_proj)
    GatedMLP        gate_up_linear (gate/up concatenated), down_linear (down_proj)
    CausalLM        logits_product (the LM head: lm_head's weight, or the tied embedding's)

Every parameter keeps its name and shape (the fused weights are concatenations, and each
projection's parameter is re-pointed at its slice, so nothing is duplicated); `cpu_gemm` may
then move the products onto oneDNN-reordered weights. Every operation is per row, so a row's
bits still do not depend on the rows computed with it; they differ from the plain modules' by
rounding only (float32 logits stay within tests/engine/models/test_logits_vs_hf.py's tolerance of
transformers').
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtool.engine.kernels.attention import attend, attend_rows
from kvtool.engine.models.cpu_gemm import CpuLinear
from kvtool.engine.models.layers import CausalLM, DecoderLayer, GatedMLP, RMSNorm, concat_linear_params, pad_rows_on_cpu
from kvtool.engine.models.llama import LlamaAttention
from kvtool.engine.models.parallel import RowParallelLinear
from kvtool.engine.models.qwen3 import Qwen3Attention


def _rms_scaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, as a new tensor: one reduction pass (the
    2-norm) and one scaling pass (fewer passes than torch's rms_norm on CPU)."""
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return torch.mul(x, r.square_().div_(x.shape[-1]).add_(eps).rsqrt_())


def _rms_forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return _rms_scaled(x, self.eps).mul_(self.weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D] (half-split convention), in fewer passes than
    layers.apply_rotary: the rotated half is built in place of a concatenation."""
    half = x.shape[-1] // 2
    rotated = torch.empty_like(x)
    torch.neg(x[..., half:], out=rotated[..., :half])
    rotated[..., half:] = x[..., :half]
    rotated.mul_(sin[:, None, :])
    return torch.addcmul(rotated, x, cos[:, None, :])


def _project_out(proj: nn.Linear, product: CpuLinear, x: torch.Tensor) -> torch.Tensor:
    """o_proj / down_proj of x through its product; a row-parallel one sums its bias-free
    partial product over the ranks, then adds the bias once."""
    if isinstance(proj, RowParallelLinear):
        return proj.reduce(product(x))
    return product(x)


def _qkv(self: LlamaAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotated q [T, Hq, D], rotated k and v [T, Hkv, D] of x [T, hidden]."""
    t, d = x.shape[0], self.head_dim
    hq, hkv = self.num_heads, self.num_kv_heads
    qkv = self.qkv_linear(x).view(t, hq + 2 * hkv, d)
    v = qkv[:, hq + hkv :]
    qk = qkv[:, : hq + hkv]
    if isinstance(self, Qwen3Attention):  # per-head norms of q and k (one eps: the model's)
        qk = _rms_scaled(qk, self.q_norm.eps)
        qk[:, :hq].mul_(self.q_norm.weight)
        qk[:, hq:].mul_(self.k_norm.weight)
    qk = _rotate(qk, cos, sin)
    return qk[:, :hq], qk[:, hq:], v


def _attention_forward(self: LlamaAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    q, k, v = _qkv(self, x, cos, sin)
    return _project_out(self.o_proj, self.o_linear, attend(self.layer_idx, q, k, v, self.scale, window=self.sliding_window))


def _layer_forward_rows(self: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        rows: torch.Tensor, few: int) -> torch.Tensor:
    """DecoderLayer.forward_rows with attention and its output projection for `rows` only too
    (every row's K/V is still stored)."""
    attn = self.self_attn
    q, k, v = _qkv(attn, self.input_layernorm(h), cos, sin)
    a = _project_out(attn.o_proj, attn.o_linear, attend_rows(attn.layer_idx, q, k, v, attn.scale, rows, window=attn.sliding_window))
    h = pad_rows_on_cpu(h.index_select(0, rows), few)
    h = h + a[: h.shape[0]]
    return h + self.mlp(self.post_attention_layernorm(h))


def _mlp_forward(self: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    gate_up = self.gate_up_linear(x)
    n = gate_up.shape[1] // 2
    gate = F.silu(gate_up[:, :n], inplace=True)  # in place: no [T, n] allocation per layer
    return _project_out(self.down_proj, self.down_linear, gate.mul_(gate_up[:, n:]))


def _out_product(proj: nn.Linear) -> CpuLinear:
    """o_proj's or down_proj's product (a row-parallel one's bias comes after its all-reduce)."""
    bias = None if isinstance(proj, RowParallelLinear) else proj.bias
    return CpuLinear(proj.weight, bias, frees=(proj.weight,))


def fuse_cpu_modules(model: CausalLM) -> list[CpuLinear]:
    """Set the model's norms, attention blocks, MLPs, last-layer rows and LM head to the fused
    forwards above. Returns every product, in module order (the LM head first); none for a
    model whose modules are not the ones these forwards are written for (`CausalLM.fused_forwards`)."""
    products: list[CpuLinear] = []
    if not model.fused_forwards:
        return products
    for module in model.modules():
        if isinstance(module, CausalLM):
            tied = module.lm_head is None
            weight = module.model.embed_tokens.weight if tied else module.lm_head.weight
            module.logits_product = CpuLinear(weight, frees=() if tied else (weight,))  # a tied head is the embedding
            products.append(module.logits_product)
        elif isinstance(module, RMSNorm):
            module.fast_forward = _rms_forward
        elif isinstance(module, GatedMLP):
            weight = concat_linear_params([module.gate_proj, module.up_proj], "weight")
            module.gate_up_linear = CpuLinear(weight, frees=(module.gate_proj.weight, module.up_proj.weight))
            module.down_linear = _out_product(module.down_proj)
            module.fast_forward = _mlp_forward
            products += [module.gate_up_linear, module.down_linear]
        elif isinstance(module, DecoderLayer) and isinstance(module.self_attn, LlamaAttention):
            module.fast_forward_rows = _layer_forward_rows
        if isinstance(module, LlamaAttention):
            projections = [module.q_proj, module.k_proj, module.v_proj]
            weight, bias = concat_linear_params(projections, "weight"), concat_linear_params(projections, "bias")
            module.qkv_linear = CpuLinear(weight, bias, frees=tuple(p.weight for p in projections))
            module.o_linear = _out_product(module.o_proj)
            module.fast_forward = _attention_forward
            products += [module.qkv_linear, module.o_linear]
    return products
