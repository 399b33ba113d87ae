"""The sparse mixture-of-experts MLP of Mixtral and Qwen3-MoE.

A router (`gate`, [experts, hidden], no bias) scores each token; the block keeps the top-k
experts, each a SwiGLU MLP of its own (shared-nothing: no shared expert), and sums their outputs
weighted by the routing probabilities. Routing follows transformers exactly:

    probs = softmax(router_logits, in float32)
    weights, experts = topk(probs, k)
    renormalise weights to sum to one     Mixtral: always; Qwen3-MoE: when norm_topk_prob
    weights cast to the logits' dtype     Qwen3-MoE only (Mixtral multiplies in float32)

and so does the sum: expert by expert in ascending order, each over the tokens routed to it,
weighted after down_proj, `index_add_` into zeros in the hidden dtype.

The forward below is that loop, in plain PyTorch (FastPaths.moe_experts == "torch"). On CPU the
router's and each expert's rows are padded to a multiple of ROW_MULTIPLE
(`layers.pad_rows_on_cpu`; a small step's few rows would take other BLAS kernels), so a row's bits
do not depend on the rows computed or routed beside it. The loop picks experts and rows on the
host, so it cannot be captured in a CUDA graph. On CUDA `apply_fast_paths` sets `fast_forward` to
`fused_ops`' MoE forward instead ("triton"): the router through `row_invariant_gemm.linear`, the
experts through `kernels.fused_moe` over weights stacked per block (`w13`, `w2`; the experts'
own parameters become views of them), with the loop's rounding steps, in CUDA graphs and
row-invariant at every batch size.

Tensor parallelism as vLLM without expert parallelism: every rank holds every expert's gate/up
rows and down columns of its share (`parallel.shard_slices`) and the whole router; the weighted
partial sums are all-reduced once, after the block.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvtool.engine.models.layers import pad_rows_on_cpu
from kvtool.engine.models.model_dir import ModelConfig
from kvtool.engine.models.parallel import MOE_NAMES
from kvtool.engine.models.shard_layout import TPRank, split_range


class Expert(nn.Module):
    """One SwiGLU expert, its projections named as the checkpoint names them (`names`: gate, up,
    down). At tp.size > 1 the rank's gate/up rows and down columns; down's sum is partial."""

    def __init__(self, hidden_size: int, rows: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        self.add_module(gate, nn.Linear(hidden_size, rows, bias=False))
        self.add_module(up, nn.Linear(hidden_size, rows, bias=False))
        self.add_module(down, nn.Linear(rows, hidden_size, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] (this rank's partial sum at tp.size > 1)."""
        gate, up, down = (self._modules[n] for n in self.names)
        return down(F.silu(gate(x)) * up(x))


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one layer: `gate` (the router) and `experts`."""

    def __init__(self, config: ModelConfig, tp: TPRank = TPRank()) -> None:
        super().__init__()
        moe = config.moe
        _, names = MOE_NAMES[config.architecture]
        rows = split_range(moe.expert_intermediate_size, tp.size, tp.rank)[1]
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config.hidden_size, rows, names) for _ in range(moe.num_experts))
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        # transformers' Mixtral weighs the experts' outputs in float32; Qwen3-MoE in the logits' dtype.
        self.float32_weights = config.architecture == "MixtralForCausalLM"
        self.tp = tp
        # fast_forward(self, x): the fused experts (set by `apply_fast_paths` on CUDA, with `w13`
        # [E, 2I, H] and `w2` [E, H, I]); None runs the loop below.
        self.fast_forward: Callable[[SparseMoeBlock, torch.Tensor], torch.Tensor] | None = None

    def stack_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' weights stacked for one grouped product each: (w13 [E, 2I, H], each
        expert's gate rows then its up rows; w2 [E, H, I]). Every expert's parameters become
        views of them, so no memory is duplicated."""
        gate, up, down = self.experts[0].names
        w13 = torch.stack([torch.cat([e._modules[gate].weight.data, e._modules[up].weight.data]) for e in self.experts])
        w2 = torch.stack([e._modules[down].weight.data for e in self.experts])
        rows = w13.shape[1] // 2
        for i, e in enumerate(self.experts):
            e._modules[gate].weight = nn.Parameter(w13[i, :rows], requires_grad=False)
            e._modules[up].weight = nn.Parameter(w13[i, rows:], requires_grad=False)
            e._modules[down].weight = nn.Parameter(w2[i], requires_grad=False)
        return w13, w2

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k], expert ids [T, k]), as transformers' routers."""
        return self.route_logits(self.gate(pad_rows_on_cpu(x))[: x.shape[0]])

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's logits [T, experts] -> (weights [T, k], expert ids [T, k])."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_weights:
            weights = weights.to(logits.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]: each token's top-k experts, weighted and summed."""
        if self.fast_forward is not None:
            return self.fast_forward(self, x)
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        # mask[e, j, t]: token t's j-th choice is expert e.
        mask = F.one_hot(experts, len(self.experts)).permute(2, 1, 0)
        for e in mask.sum(dim=(1, 2)).nonzero().flatten().tolist():
            choice, rows = torch.where(mask[e])
            y = self.experts[e](pad_rows_on_cpu(x[rows]))[: rows.shape[0]]
            out.index_add_(0, rows, (y * weights[rows, choice, None]).to(out.dtype))
        if self.tp.size > 1:
            dist.all_reduce(out)
        return out
