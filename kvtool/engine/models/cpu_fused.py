"""Fused forwards for a model on CPU: one GEMM for q/k/v and one for gate/up, an RMSNorm of two
passes (one 2-norm reduction, one scaling), and one norm and one rotation for q and k together.

`build_model` applies them to a model built on CPU. Every parameter keeps its name and shape
(the fused weights are concatenations, and each projection's parameter is re-pointed at its
slice, so nothing is duplicated). The fused products are `cpu_gemm.CpuLinear`s, which the
runner moves onto oneDNN-reordered weights with the other projections. Every operation is per
row, so a row's bits still do not depend on the rows computed with it; they differ from the
plain modules' by rounding only (float32 logits stay within
tests/integration/test_logits_vs_hf.py's tolerance of transformers').
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from kvtool.engine.attention import attend, attend_rows
from kvtool.engine.models.cpu_gemm import CpuLinear
from kvtool.engine.models.layers import DecoderLayer, GatedMLP, RMSNorm, concat_linear_params, pad_rows_on_cpu
from kvtool.engine.models.llama import LlamaAttention
from kvtool.engine.models.qwen3 import Qwen3Attention


def _rms_scaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, as a new tensor: one reduction pass (the
    2-norm) and one scaling pass (torch's rms_norm takes about twice as long on CPU)."""
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
    return self.o_proj(attend(self.layer_idx, q, k, v, self.scale))


def _layer_forward_rows(self: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        rows: torch.Tensor, few: int) -> torch.Tensor:
    """DecoderLayer.forward_rows with attention and its output projection for `rows` only too
    (every row's K/V is still stored)."""
    attn = self.self_attn
    q, k, v = _qkv(attn, self.input_layernorm(h), cos, sin)
    a = attn.o_proj(attend_rows(attn.layer_idx, q, k, v, attn.scale, rows))
    h = pad_rows_on_cpu(h.index_select(0, rows), few)
    h = h + a[: h.shape[0]]
    return h + self.mlp(self.post_attention_layernorm(h))


def _mlp_forward(self: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    gate_up = self.gate_up_linear(x)
    n = gate_up.shape[1] // 2
    gate = F.silu(gate_up[:, :n], inplace=True)  # in place: no [T, n] allocation per layer
    return self.down_proj(gate.mul_(gate_up[:, n:]))


def apply_cpu_fusion(model: nn.Module) -> None:
    """Route the model's norms, attention projections and MLPs to the fused forwards above."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = types.MethodType(_rms_forward, module)
        elif isinstance(module, GatedMLP):
            module.gate_up_linear = CpuLinear(concat_linear_params([module.gate_proj, module.up_proj], "weight"))
            module.forward = types.MethodType(_mlp_forward, module)
        elif isinstance(module, DecoderLayer) and isinstance(module.self_attn, LlamaAttention):
            module.forward_rows = types.MethodType(_layer_forward_rows, module)
        if isinstance(module, LlamaAttention):
            projections = [module.q_proj, module.k_proj, module.v_proj]
            module.qkv_linear = CpuLinear(concat_linear_params(projections, "weight"),
                                          concat_linear_params(projections, "bias"))
            module.forward = types.MethodType(_attention_forward, module)
