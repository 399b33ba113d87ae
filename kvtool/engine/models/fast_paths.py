"""Every fast path of a built model, chosen in one place: `apply_fast_paths(model, device, dtype)`.

The model modules compute with the plain PyTorch ops written in them unless one of their
declared fields is set. This function alone sets those fields, once, before the first step, and
returns what it chose as a `FastPaths` value that the runner receives:

    field (module)                       CPU (`cpu_fused`, `cpu_gemm`)      CUDA bf16/fp16 (`fused_ops`)
    fast_forward (RMSNorm)               two-pass norm                      Triton norm
    fast_forward (LlamaAttention,        one q/k/v product, one norm and    one q/k/v GEMM, one kernel for
      Qwen3Attention, GemmaAttention)    rotation for q and k together      q/k norms, RoPE and the K/V store
    fast_forward (GatedMLP)              one gate/up product                one gate/up GEMM, a SiLU kernel
    fast_forward_rows (DecoderLayer)     attention and o_proj of the        -
                                         sampled rows only
    fast_forward (DecoderModel)          -                                  residual adds inside the norms;
                                                                            last layer for sampled rows only
    fast_forward (GemmaRMSNorm,          -                                  Gemma's norm kernel; gate/up GEMM
      GegluMLP, GemmaModel)                                                 and a GeGLU kernel; its decoder loop
    logits_product (CausalLM)            oneDNN over a reordered weight     `row_invariant_gemm.linear`
    few_rows_multiple (DecoderModel)     probed (`cpu_gemm`)                ROW_MULTIPLE (CPU padding only)

The CPU column applies to models of Llama's modules (`CausalLM.fused_forwards`); Gemma's run their
own forwards on CPU. The CUDA column applies to every model with fused CUDA forwards
(`CausalLM.cuda_fused_forwards`): Gemma's modules (`gemma`) take the Gemma rows above and
GemmaAttention the attention row (Gemma 3's q/k norms in Gemma's form, its window and soft cap
passed to the attention kernels).

On CPU every product (q/k/v, o_proj, gate/up, down_proj, LM head) moves onto a weight that
oneDNN reordered once, where it can (float32, a torch with oneDNN). On CUDA the fused kernels
need the CUDA attention backend; each step says whether its products are row-invariant (the
runner sets `AttentionMetadata.row_invariant` and `compute_logits(row_invariant=)`), so
engines of different batch-invariance settings share nothing.

MoE blocks (`moe.SparseMoeBlock`: Mixtral, Qwen3-MoE): on CUDA with the fused kernels their
router goes through `row_invariant_gemm.linear` and their experts through `kernels.fused_moe`
(FastPaths.moe_experts == "triton"), whose rows are row-invariant at every batch size and which
decides nothing on the host, so decode steps are captured in CUDA graphs as a dense model's are.
Elsewhere (CPU, or CUDA without the fused kernels) they run the plain PyTorch expert loop
("torch"), which picks experts and rows on the host: FastPaths.cuda_graphs is then False and the
runner captures no decode (nor one-token prefill) graphs. Their attention, norms, dense MLPs and
LM head take the paths above: those modules are the dense models' own classes, and the fused
decoder loop only calls each layer's `mlp`.

The runner calls this after the KV pages are sized, before its first step: on CUDA, fusing
returns the unfused weights to the allocator's cache, which sizing would count as in use.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

from kvtool.engine.kernels.attention import ROW_MULTIPLE, select_backend
from kvtool.engine.models.fp8_linear import Fp8Linear
from kvtool.engine.models.layers import CausalLM, GatedMLP

Kernels = Literal["reference", "cpu", "triton"]
# "torch": F.linear over the dense weight; "onednn": oneDNN over a weight reordered once;
# "cuda": `row_invariant_gemm.linear` (cuBLAS or a GEMV, or the row-invariant kernel where the
# step asks for it); "fp8": `kernels.fp8_gemm` over an FP8 checkpoint's weights as stored
# (`fp8_linear.Fp8Linear`); "mixed": some products of that kind one way, some another.
GemmRoute = Literal["torch", "onednn", "cuda", "fp8", "mixed"]


class GemmRoutes(msgspec.Struct, frozen=True):
    """The product route of each kind of projection."""

    qkv: GemmRoute
    o_proj: GemmRoute
    gate_up: GemmRoute
    down_proj: GemmRoute
    lm_head: GemmRoute


class FastPaths(msgspec.Struct, frozen=True):
    """What `apply_fast_paths` chose for one model; the runner reads it, nothing else sets it."""

    # Norms, RoPE and activations: the modules' own ops, the CPU fused ops, or Triton kernels.
    kernels: Kernels
    # q/k/v of every attention block as one product over a concatenated weight.
    fused_qkv: bool
    # gate/up of every MLP as one product over a concatenated weight.
    fused_gate_up: bool
    # CUDA: the decoder loop that adds each residual inside the norm after it.
    residual_in_norm: bool
    # Given a step's sample rows, the forward computes the last layer for those rows alone, with
    # the bits they have in the full forward: the runner passes them.
    sampled_rows_only: bool
    gemm: GemmRoutes
    # Weights moved onto oneDNN's reordered layout (CPU); 0 elsewhere.
    packed_weights: int
    # A step of at most ROW_MULTIPLE rows is padded to a multiple of this (CPU).
    few_rows_multiple: int
    # MoE blocks: "triton", the fused experts of `kernels.fused_moe` (CUDA); "torch", the plain
    # expert loop of `moe`; "none" in a dense model.
    moe_experts: Literal["none", "torch", "triton"] = "none"
    # Whether the runner may capture the decode step in CUDA graphs (not with the expert loop).
    cuda_graphs: bool = True


def apply_fast_paths(
    model: CausalLM, device: torch.device | str, dtype: torch.dtype, *, backend: str = "auto", fused: bool = True
) -> FastPaths:
    """Choose and apply every fast path of `model` (built on `device` in `dtype`) and return the
    choice. `backend` is the runner's attention backend setting ("reference" keeps the CUDA
    kernels off); fused=False keeps every module's own forward (tests, benchmarks). Call it
    once per model."""
    return _with_moe(model, _apply(model, torch.device(device), dtype, backend, fused))


def _apply(model: CausalLM, device: torch.device, dtype: torch.dtype, backend: str, fused: bool) -> FastPaths:
    if fused and device.type == "cpu":
        if model.fused_forwards:
            return _apply_cpu(model)
    elif (fused and model.cuda_fused_forwards and backend != "reference"
          and select_backend(device, dtype, model.config.head_dim) == "cuda"):
        from kvtool.engine.models.fused_ops import can_fuse

        if can_fuse(model):
            return _apply_cuda(model)
    torch_routes = GemmRoutes(qkv="torch", o_proj="torch", gate_up="torch", down_proj="torch", lm_head="torch")
    return FastPaths(kernels="reference", fused_qkv=False, fused_gate_up=False, residual_in_norm=False,
                     sampled_rows_only=device.type == "cpu", gemm=torch_routes, packed_weights=0,
                     few_rows_multiple=ROW_MULTIPLE)


def _with_moe(model: CausalLM, paths: FastPaths) -> FastPaths:
    """`paths` of a model with MoE blocks: fused experts where `apply_fused_ops` set them (their
    products count as "cuda" ones), else the plain loop (F.linear: "torch" products) without
    CUDA graphs."""
    layers = model.model.layers
    blocks = [layer.mlp for layer in layers if not isinstance(layer.mlp, GatedMLP)]
    if not blocks:
        return paths
    fused = all(block.fast_forward is not None for block in blocks)
    experts: GemmRoute = "cuda" if fused else "torch"
    routes = paths.gemm
    if len(blocks) == len(layers):
        gate_up = down = experts
    else:
        gate_up = routes.gate_up if routes.gate_up == experts else "mixed"
        down = routes.down_proj if routes.down_proj == experts else "mixed"
    gemm = msgspec.structs.replace(routes, gate_up=gate_up, down_proj=down)
    if fused:
        return msgspec.structs.replace(paths, gemm=gemm, moe_experts="triton", fused_gate_up=True)
    return msgspec.structs.replace(paths, gemm=gemm, moe_experts="torch", cuda_graphs=False, fused_gate_up=False)


def _route(count: int, total: int, route: GemmRoute) -> GemmRoute:
    """`route` where all `total` products of a kind take it, "torch" where none does."""
    if count == total:
        return route
    return "torch" if count == 0 else "mixed"


def _fp8(modules: list, leaf: str, route: GemmRoute) -> GemmRoute:
    """`route`, "fp8" where every module's `leaf` projection is an `Fp8Linear`, "mixed" where some are."""
    fp8 = sum(isinstance(getattr(m, leaf), Fp8Linear) for m in modules)
    if fp8 == 0 or route == "torch":
        return route
    return "fp8" if fp8 == len(modules) else "mixed"


def _apply_cpu(model: CausalLM) -> FastPaths:
    from kvtool.engine.models.cpu_fused import fuse_cpu_modules
    from kvtool.engine.models.cpu_gemm import few_rows_multiple, pack_cpu_linears

    products = fuse_cpu_modules(model)
    moved = pack_cpu_linears(products)
    few = ROW_MULTIPLE
    if moved and model.tp.size == 1:
        few = few_rows_multiple(products)
        model.model.few_rows_multiple = few
    layers = model.model.layers
    attn = [layer.self_attn for layer in layers]
    mlps = [layer.mlp for layer in layers if isinstance(layer.mlp, GatedMLP)]  # MoE blocks: `_with_moe`
    gemm = GemmRoutes(
        qkv=_route(sum(a.qkv_linear.packed for a in attn), len(attn), "onednn"),
        o_proj=_route(sum(a.o_linear.packed for a in attn), len(attn), "onednn"),
        gate_up=_route(sum(m.gate_up_linear.packed for m in mlps), len(mlps), "onednn"),
        down_proj=_route(sum(m.down_linear.packed for m in mlps), len(mlps), "onednn"),
        lm_head=_route(int(model.logits_product.packed), 1, "onednn"),
    )
    return FastPaths(kernels="cpu", fused_qkv=True, fused_gate_up=True, residual_in_norm=False,
                     sampled_rows_only=True, gemm=gemm, packed_weights=moved, few_rows_multiple=few)


def _apply_cuda(model: CausalLM) -> FastPaths:
    from kvtool.engine.models.fused_ops import apply_fused_ops

    done = apply_fused_ops(model)
    fused_qkv = done.num_attention > 0 and done.attention == done.num_attention
    qkv = _route(done.attention, done.num_attention, "cuda")
    mlp = "cuda" if done.mlps else "torch"
    layers = model.model.layers
    attn = [layer.self_attn for layer in layers]
    mlps = [layer.mlp for layer in layers if isinstance(layer.mlp, GatedMLP)]
    gemm = GemmRoutes(qkv=_fp8(attn, "q_proj", qkv), o_proj=_fp8(attn, "o_proj", qkv),
                      gate_up=_fp8(mlps, "gate_proj", mlp), down_proj=_fp8(mlps, "down_proj", mlp), lm_head="cuda")
    return FastPaths(kernels="triton", fused_qkv=fused_qkv, fused_gate_up=done.mlps > 0, residual_in_norm=done.decoder,
                     sampled_rows_only=done.decoder and model.model.layers[-1].self_attn.fast_forward is not None,
                     gemm=gemm, packed_weights=0, few_rows_multiple=ROW_MULTIPLE)
