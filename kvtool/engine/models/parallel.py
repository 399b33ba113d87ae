"""Megatron-style tensor-parallel pieces, as vLLM shards a decoder: which slice of each full
weight a rank holds, the row-parallel linear that all-reduces its partial sums, the
vocab-parallel embedding, and the gather that gives every rank the full logits.

Column-parallel projections (q/k/v, gate/up) need no module of their own: they are plain
`nn.Linear`s with the rank's rows, and their outputs stay local to the rank (its heads, its MLP
rows). Row-parallel ones (o_proj, down_proj) see the rank's columns of the input and sum over
the ranks with ONE all-reduce. Every split comes from `shard_layout`, so the engine, the weight
loader and the connectors agree on which heads and rows a rank holds.

An MoE block (`moe`) shards as vLLM's does without expert parallelism: every expert's gate/up
rows and down columns as a dense MLP's, the router replicated, ONE all-reduce after the block.

At tp.size == 1 none of this is used: the models build today's plain modules.
Collectives run on torch.distributed's default process group, which the caller initialises.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvtool.engine.models.model_dir import ModelConfig
from kvtool.engine.models.shard_layout import TPRank, kv_head_range, query_head_range, split_range

__all__ = [
    "MOE_NAMES",
    "RankHeads",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "gather_vocab",
    "rank_heads",
    "shard_slices",
]


# An MoE block's checkpoint names: its attribute in a layer, and each expert's gate, up and down
# projections (model.layers.N.<block>.experts.E.<projection>.weight; the router is <block>.gate).
MOE_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


class RankHeads(msgspec.Struct, frozen=True):
    """The heads one rank holds: query heads [q_start, q_start + num_heads), KV heads
    [kv_start, kv_start + num_kv_heads). Its KV pages have `num_kv_heads` heads."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def rank_heads(config: ModelConfig, tp: TPRank) -> RankHeads:
    """The query and KV heads rank `tp.rank` holds (its KV geometry has `.num_kv_heads`)."""
    q_start, num_heads = query_head_range(config.num_heads, config.num_kv_heads, tp)
    kv_start, num_kv_heads = kv_head_range(config.num_kv_heads, tp)
    return RankHeads(q_start=q_start, num_heads=num_heads, kv_start=kv_start, num_kv_heads=num_kv_heads)


def shard_slices(config: ModelConfig, tp: TPRank) -> dict[str, tuple[int, int, int]]:
    """HF weight name -> (dim, start, count): the slice of the full tensor rank `tp.rank` holds.

    Names absent from the result are replicated (norms, a row-parallel bias). Empty at tp.size 1.
    """
    if tp.size == 1:
        return {}
    heads = rank_heads(config, tp)
    d = config.head_dim
    q = (heads.q_start * d, heads.num_heads * d)
    kv = (heads.kv_start * d, heads.num_kv_heads * d)
    mlp = split_range(config.intermediate_size, tp.size, tp.rank)
    vocab = split_range(config.vocab_size, tp.size, tp.rank)
    slices = {"model.embed_tokens.weight": (0, *vocab)}
    if not config.tie_word_embeddings:
        slices["lm_head.weight"] = (0, *vocab)
    for i in range(config.num_layers):
        attn, mlp_prefix = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for suffix in ("weight", "bias") if config.attention_bias else ("weight",):
            slices[f"{attn}q_proj.{suffix}"] = (0, *q)
            slices[f"{attn}k_proj.{suffix}"] = (0, *kv)
            slices[f"{attn}v_proj.{suffix}"] = (0, *kv)
        slices[f"{attn}o_proj.weight"] = (1, *q)
        if config.moe is not None and i in config.moe.sparse_layers:
            slices.update(_expert_slices(config, tp, i))
            continue
        slices[f"{mlp_prefix}gate_proj.weight"] = (0, *mlp)
        slices[f"{mlp_prefix}up_proj.weight"] = (0, *mlp)
        slices[f"{mlp_prefix}down_proj.weight"] = (1, *mlp)
    return slices


def _expert_slices(config: ModelConfig, tp: TPRank, layer: int) -> dict[str, tuple[int, int, int]]:
    """Every expert's gate/up rows and down columns rank `tp.rank` holds in MoE layer `layer`."""
    block, (gate, up, down) = MOE_NAMES[config.architecture]
    rows = split_range(config.moe.expert_intermediate_size, tp.size, tp.rank)
    slices = {}
    for e in range(config.moe.num_experts):
        prefix = f"model.layers.{layer}.{block}.experts.{e}."
        slices[f"{prefix}{gate}.weight"] = (0, *rows)
        slices[f"{prefix}{up}.weight"] = (0, *rows)
        slices[f"{prefix}{down}.weight"] = (1, *rows)
    return slices


class RowParallelLinear(nn.Linear):
    """A linear over the rank's input columns: local partial sums, ONE all-reduce, then the
    (replicated) bias once, as vLLM's RowParallelLinear with reduce_results."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in/ranks] -> [T, out], summed over the ranks."""
        return self.reduce(F.linear(x, self.weight))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a bias-free partial product over the ranks in place, then add the bias."""
        dist.all_reduce(partial)
        return partial if self.bias is None else partial + self.bias


class VocabParallelEmbedding(nn.Module):
    """The rank's rows [start, start + count) of the embedding: ids outside them look up zeros,
    and one all-reduce sums the ranks' rows (exactly one rank is non-zero, so the sum is exact).
    Tied models read `weight` as the rank's shard of the LM head too."""

    def __init__(self, vocab_size: int, dim: int, tp: TPRank) -> None:
        super().__init__()
        self.start, count = split_range(vocab_size, tp.size, tp.rank)
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(count, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, dim]."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside[:, None], 0.0)
        dist.all_reduce(h)
        return h


def gather_vocab(local: torch.Tensor, vocab_size: int, tp: TPRank) -> torch.Tensor:
    """Every rank's logits columns [N, its vocab share] -> the full [N, vocab] on every rank.

    Shares may differ by one column (split_range); each is padded to the largest so the
    all-gather moves equal blocks (gloo and NCCL both need that), then the padding is dropped.
    """
    widest = split_range(vocab_size, tp.size, 0)[1]
    n, width = local.shape
    if width < widest:
        local = torch.cat([local, local.new_zeros((n, widest - width))], dim=1)
    blocks = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(blocks, local.contiguous())
    return torch.cat([b[:, : split_range(vocab_size, tp.size, r)[1]] for r, b in enumerate(blocks)], dim=1)
