"""The products of a float32 model on CPU through oneDNN, over weights reordered once.

`F.linear` on CPU is MKL's sgemm, which packs its weight operand again on every call. A decode
step is a few rows (padded to ROW_MULTIPLE), so that repacking and MKL's small-row kernels
dominate it. oneDNN's matmul over a weight reordered into its blocked layout ahead of time does
neither, and its prefill rows are no slower.

Every product of a CPU model with fused forwards (`cpu_fused`: q/k/v, o_proj, gate/up,
down_proj, the LM head) is a `CpuLinear`. `pack_cpu_linears(products)` moves each onto such a
weight and frees the dense matrix that only that product read (the embedding stays dense: a
tied LM head is the embedding, so it gets a reordered copy); `fast_paths.apply_fast_paths`
calls it once, before the first step. A row's bits through oneDNN do not depend on how many
rows are computed with it, for the row counts the CPU path uses (multiples of ROW_MULTIPLE);
they differ from MKL's by rounding only. tests/engine/models/test_cpu_gemm.py checks both on the
machine that runs it.

Where torch has no oneDNN, or refuses to reorder a weight, and for any dtype but float32, a
product stays `F.linear` over the dense weight.

A step of at most ROW_MULTIPLE rows (a decode step of a few sequences) need not be padded to 16
rows where the machine's products give 4 or 8 rows the bits of larger batches:
`few_rows_multiple(products)` tries every distinct product at 4, 8 and 12 rows (then at 8)
against the same rows of a 64-row product, once, and returns the first multiple that matches
everywhere (else ROW_MULTIPLE); `apply_fast_paths` pads the model's small steps to it. A decode
step of one sequence then computes 4 rows instead of 16. Tensor-parallel ranks keep
ROW_MULTIPLE (each would try its own shard's shapes, and every rank must pad alike).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtool.engine.kernels.attention import ROW_MULTIPLE

# Candidates for a model's `few_rows_multiple`, tried in order; each divides ROW_MULTIPLE.
FEW_ROWS_MULTIPLES = (4, 8)
# The rows of the product the few-row results are compared with (a multiple of ROW_MULTIPLE).
PROBE_ROWS = 64


class CpuLinear:
    """x [T, in] -> x @ weight.T + bias, [T, out]: `F.linear` over a dense weight, or oneDNN's
    matmul over a reordered one (`packed`). `frees`: the dense parameters whose elements `pack`
    lets go of (the ones only this product reads)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False,
                 frees: tuple[torch.Tensor, ...] = ()) -> None:
        self.weight = weight
        self.bias = bias
        self.packed = packed
        self.frees = frees

    def __call__(self, x: torch.Tensor, row_invariant: bool = True) -> torch.Tensor:
        """The product; `row_invariant` is there for `CausalLM.logits_product` and changes nothing:
        on CPU a row's bits never depend on the rows beside it (multiples of ROW_MULTIPLE)."""
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

    def pack(self) -> bool:
        """Move onto the reordered weight (`reordered`) and free `frees`. Returns whether it moved."""
        moved = self.reordered()
        if moved is self:
            return False
        self.weight, self.packed = moved.weight, True
        for p in self.frees:
            # The parameter keeps its name but no elements, so a stray read fails on its shape
            # instead of computing with a stale matrix.
            p.data = torch.empty(0, dtype=p.dtype)
        self.frees = ()
        return True


def pack_cpu_linears(products: list[CpuLinear]) -> int:
    """Move the products onto reordered weights (`CpuLinear.pack`). Returns how many moved; a
    second call finds them moved and does nothing."""
    return sum(p.pack() for p in products)


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
