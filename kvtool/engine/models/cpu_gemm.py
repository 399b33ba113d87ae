"""The products of a float32 model on CPU through oneDNN, over weights reordered once.

`F.linear` on CPU is MKL's sgemm, which packs its weight operand again on every call. A decode
step is a few rows (padded to ROW_MULTIPLE), so that repacking and MKL's small-row kernels
dominate it. oneDNN's matmul over a weight reordered into its blocked layout ahead of time does
neither: on a 2-core AVX-512 guest the embedded model's projections and LM head took half
MKL's time per 16-row step, and its prefill rows were faster too (docs/benchmarks/, 2026-12-05).

`pack_cpu_linears(model)` moves every q/k/v, o_proj, gate/up, down_proj and LM head product of a
CPU model (as `cpu_fused` set them up) onto such a weight and frees the dense matrix that only
that product read (the embedding stays dense: a tied LM head is the embedding, so it gets a
reordered copy). The runner calls it once, before the first step. A row's bits through oneDNN
do not depend on how many rows are computed with it, for the row counts the CPU path uses
(multiples of ROW_MULTIPLE); they differ from MKL's by rounding only. tests/unit/test_cpu_gemm.py
checks both on the machine that runs it.

Where torch has no oneDNN, or refuses to reorder a weight, and for any dtype but float32, a
product stays `F.linear` over the dense weight.

A step of at most ROW_MULTIPLE rows (a decode step of a few sequences) need not be padded to 16
rows where the machine's products give 4 or 8 rows the bits of larger batches: `pack_cpu_linears`
tries every distinct product of the model at 4, 8 and 12 rows (then at 8) against the same rows
of a 64-row product, once, and sets the model's `few_rows_multiple` to the first multiple that
matches everywhere (else it stays ROW_MULTIPLE). A decode step of one sequence then computes 4
rows instead of 16: a third less time on the embedded model. Tensor-parallel ranks keep
ROW_MULTIPLE (each would try its own shard's shapes, and every rank must pad alike).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from kvtool.engine.attention import ROW_MULTIPLE
from kvtool.engine.models.parallel import RowParallelLinear

# Candidates for a model's `few_rows_multiple`, tried in order; each divides ROW_MULTIPLE.
FEW_ROWS_MULTIPLES = (4, 8)
# The rows of the product the few-row results are compared with (a multiple of ROW_MULTIPLE).
PROBE_ROWS = 64


class CpuLinear:
    """x [T, in] -> x @ weight.T + bias, [T, out]: `F.linear` over a dense weight, or oneDNN's
    matmul over a reordered one (`packed`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False) -> None:
        self.weight = weight
        self.bias = bias
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def reordered(self) -> CpuLinear:
        """This product over oneDNN's blocked copy of the weight, or itself where that is not available."""
        w = self.weight
        if self.packed or w.device.type != "cpu" or w.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return self
        try:
            blocked = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        except (AttributeError, RuntimeError):  # an older torch, or a CPU this oneDNN cannot serve
            return self
        return CpuLinear(blocked, self.bias, packed=True)


def _free(*params: torch.Tensor) -> None:
    """Let go of dense weights a packed product replaced: each parameter keeps its name but no
    elements, so a stray read fails on its shape instead of computing with a stale matrix."""
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype)


def _projection_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return self.cpu_linear(x)


def _row_parallel_forward(self: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    return self.reduce(self.cpu_linear(x))  # the partial product; the bias once, after the sum


def _pack_fused(module: nn.Module, attr: str, parts: list[nn.Linear]) -> int:
    """Reorder a fused product (`qkv_linear`, `gate_up_linear`); its parts' weights are views of its dense weight."""
    packed = getattr(module, attr).reordered()
    if packed is getattr(module, attr):
        return 0
    setattr(module, attr, packed)
    _free(*(p.weight for p in parts))
    return 1


def _pack_projection(linear: nn.Linear) -> int:
    """Route an o_proj or down_proj through its `cpu_linear`, reordered where possible (a
    row-parallel one keeps its all-reduce and its bias after it)."""
    if getattr(linear, "cpu_linear", None) is not None:
        return 0
    row_parallel = isinstance(linear, RowParallelLinear)
    linear.cpu_linear = CpuLinear(linear.weight, None if row_parallel else linear.bias).reordered()
    linear.forward = types.MethodType(_row_parallel_forward if row_parallel else _projection_forward, linear)
    if not linear.cpu_linear.packed:
        return 0
    _free(linear.weight)
    return 1


def _pack_head(lm: nn.Module) -> int:
    """Route the LM head through `cpu_head`, reordered where possible (`CausalLM.logits_linear(hidden,
    weight)` then ignores the weight it is given: the head's own, or its freed placeholder)."""
    if getattr(lm, "cpu_head", None) is not None:
        return 0
    tied = lm.lm_head is None
    head = lm.cpu_head = CpuLinear(lm.model.embed_tokens.weight if tied else lm.lm_head.weight).reordered()
    lm.logits_linear = lambda hidden, weight: head(hidden)
    if not head.packed:
        return 0
    if not tied:  # a tied head is the embedding, which stays
        _free(lm.lm_head.weight)
    return 1


def pack_cpu_linears(model: nn.Module) -> int:
    """Move the CPU model's products onto reordered weights and set its `few_rows_multiple`.
    Returns how many weights moved; a second call finds them moved and does nothing."""
    from kvtool.engine.models.layers import CausalLM, DecoderModel, GatedMLP
    from kvtool.engine.models.llama import LlamaAttention

    moved = 0
    products: list[CpuLinear] = []
    for module in list(model.modules()):
        if isinstance(module, LlamaAttention) and hasattr(module, "qkv_linear"):
            moved += _pack_fused(module, "qkv_linear", [module.q_proj, module.k_proj, module.v_proj])
            moved += _pack_projection(module.o_proj)
            products += [module.qkv_linear, module.o_proj.cpu_linear]
        elif isinstance(module, GatedMLP) and hasattr(module, "gate_up_linear"):
            moved += _pack_fused(module, "gate_up_linear", [module.gate_proj, module.up_proj])
            moved += _pack_projection(module.down_proj)
            products += [module.gate_up_linear, module.down_proj.cpu_linear]
        elif isinstance(module, CausalLM):
            moved += _pack_head(module)
            products.append(module.cpu_head)
    tp = getattr(model, "tp", None)
    if moved and (tp is None or tp.size == 1):
        few = few_rows_multiple(products)
        for decoder in model.modules():
            if isinstance(decoder, DecoderModel):
                decoder.few_rows_multiple = few
    return moved


def few_rows_multiple(products: list[CpuLinear]) -> int:
    """The first of FEW_ROWS_MULTIPLES whose multiples below ROW_MULTIPLE give every product's
    rows the bits of the same rows in a PROBE_ROWS-row product (random inputs, one per distinct
    shape); ROW_MULTIPLE if none does."""
    gen = torch.Generator().manual_seed(0)
    distinct: dict[tuple, tuple[CpuLinear, torch.Tensor]] = {}
    for p in products:
        key = (tuple(p.weight.shape), p.bias is None, p.packed)
        if key not in distinct:
            distinct[key] = (p, torch.randn(PROBE_ROWS, p.weight.shape[1], generator=gen, dtype=p.weight.dtype))
    with torch.inference_mode():
        wanted = {key: p(x) for key, (p, x) in distinct.items()}
        for multiple in FEW_ROWS_MULTIPLES:
            if all(torch.equal(p(x[:n]), wanted[key][:n])
                   for key, (p, x) in distinct.items() for n in range(multiple, ROW_MULTIPLE, multiple)):
                return multiple
    return ROW_MULTIPLE
