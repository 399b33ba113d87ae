"""Projections that keep an FP8 checkpoint's weights in FP8 on the GPU (`Fp8Linear`).

On a CUDA device with FP8 tensor cores, a model of an FP8 checkpoint built in bf16/fp16 on one
rank holds each quantised projection as its checkpoint stores it: the float8_e4m3fn weight
(half the bytes of bf16, so more of the GPU is left for KV pages) and its float32 scales. The
fused forwards multiply by it with `kernels.fp8_gemm` (FP8 tensor cores); the module's own
forward, taken where the fused kernels are off, multiplies by its dequantised weight.

`fp8_projections` picks the modules and swaps them in before the model is materialised:
the projections a writer stores in FP8 (`quantization.is_quantized_module`) that the checkpoint
stores alone (a part of a packed tensor, such as Phi-3's qkv_proj, is dequantised as it loads)
and outside MoE experts (stacked for `kernels.fused_moe`, which computes in bf16). Block scales
need a K side the kernel's K step divides. Elsewhere (CPU, several ranks, float32, an older GPU)
every FP8 weight is dequantised as it loads, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtool.engine.kernels.fp8_weight import GROUP, Fp8Weight, block_fits, concat, supported_device
from kvtool.engine.models.model_dir import ModelConfig
from kvtool.engine.models.quantization import FP8_DTYPE, WeightQuantization, dequantize, is_quantized_module, quantize
from kvtool.engine.models.shard_layout import TPRank


class Fp8Linear(nn.Module):
    """A bias-optional linear layer over an FP8 weight [out, in] and its scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quantization: WeightQuantization) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quantization = quantization
        # float32, 2-D: block scales [ceil(out/bh), ceil(in/bw)], or one per output row [out, 1]
        self.weight_scale: torch.Tensor | None = None
        # Set by `fused_ops` for a projection multiplied alone (o_proj, down_proj).
        self.fp8_weight: Fp8Weight | None = None

    def load(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Take the checkpoint's FP8 weight and its scale (any stored shape of it) as they are."""
        self.weight.copy_(weight)
        scale = scale.to(device=self.weight.device, dtype=torch.float32)
        if self.quantization.weight_strategy != "block":
            scale = scale.reshape(-1, 1).expand(self.out_features, 1)  # per tensor: one per row
        self.weight_scale = scale.contiguous()

    def load_dense(self, weight: torch.Tensor) -> None:
        """Quantise a float weight as the checkpoint's scheme would (dummy weights)."""
        self.load(*quantize(weight, self.quantization))

    def fp8(self) -> Fp8Weight:
        """The weight in `kernels.fp8_gemm`'s form."""
        if self.quantization.weight_strategy == "block":
            rows, cols = self.quantization.weight_block_size
            return Fp8Weight(self.weight, self.weight_scale, rows, cols)
        return Fp8Weight(self.weight, self.weight_scale, 1, GROUP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, self.weight_scale, self.quantization).to(x.dtype), self.bias)


def concat_fp8_linears(linears: list[Fp8Linear]) -> Fp8Weight:
    """The linears' FP8 weights stacked for one product; each module's weight becomes a view of
    its rows, so the FP8 bytes are not duplicated."""
    whole = concat([m.fp8() for m in linears])
    at = 0
    for m in linears:
        m.weight = nn.Parameter(whole.data[at : at + m.out_features], requires_grad=False)
        at += m.out_features
    return whole


def fp8_projections(model: nn.Module, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                    tp: TPRank) -> dict[str, Fp8Linear]:
    """Swap `Fp8Linear` in for the projections that compute in FP8 (see the module doc) in a model
    built on the meta device; returns weight name -> module, empty where none does."""
    q = config.quantization
    if (q is None or tp.size > 1 or dtype not in (torch.bfloat16, torch.float16) or not supported_device(device)
            or (q.weight_strategy == "block" and not block_fits(q.weight_block_size[1]))):
        return {}
    packed_parts = {part for parts in getattr(model, "packed_modules", {}).values() for part in parts}
    swapped = {}
    for name, module in list(model.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if (type(module) is not nn.Linear or leaf in packed_parts or ".experts." in f".{name}."
                or not is_quantized_module(q, name)):
            continue
        with torch.device("meta"):
            fp8 = Fp8Linear(module.in_features, module.out_features, module.bias is not None, q)
        setattr(model.get_submodule(parent_name), leaf, fp8)
        swapped[f"{name}.weight"] = fp8
    return swapped
