"""On CPU the model can compute its last layer's attention, output projection, MLP and final
norm for the sampled rows only (`forward(ids, positions, rows)`): those rows must equal, bit for
bit, the same rows of the full forward, and the KV pages it leaves must equal the full forward's."""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.engine.kernels.attention import AttentionMetadata, SeqSpan, attention_context
from kvtool.engine.kv.pages import KVGeometry, KVPages
from kvtool.engine.models import build_model
from kvtool.engine.models.cpu_fused import fuse_cpu_modules
from kvtool.engine.models.fast_paths import apply_fast_paths
from kvtool.engine.models.model_dir import ModelConfig, parse_config
from kvtool.engine.presets.catalog import PRESETS

BS = 16


def _forward(model, config: ModelConfig, spans: list[tuple[int, int]], rows: torch.Tensor | None):
    """One step over fresh pages of sequences of the given (start, length) prompt slices, all
    from position 0. Returns (hidden, pages)."""
    g = KVGeometry(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                   block_size=BS, dtype="float32")
    pages = KVPages(g, 200, torch.device("cpu"))
    pages.tensor.zero_()
    gen = torch.Generator().manual_seed(0)
    seqs, ids, positions, blocks, offsets, at, next_block = [], [], [], [], [], 0, 0
    for _, n in spans:
        table = torch.arange(next_block, next_block + math.ceil(n / BS))
        next_block += table.numel()
        pos = torch.arange(n)
        seqs.append(SeqSpan(q_start=at, q_len=n, ctx_len=n, block_ids=table))
        ids.append(torch.randint(3, config.vocab_size, (n,), generator=gen))
        positions.append(pos), blocks.append(table[pos // BS]), offsets.append(pos % BS)
        at += n
    meta = AttentionMetadata(kv_pages=pages, seqs=seqs, slot_block_ids=torch.cat(blocks), slot_offsets=torch.cat(offsets))
    with torch.inference_mode(), attention_context(meta):
        hidden = model(torch.cat(ids), torch.cat(positions), rows)
    return hidden, pages.tensor


@pytest.mark.parametrize("products", ["reference", "dense", "onednn"])
def test_sampled_rows_equal_the_full_forward(products):
    config = parse_config(PRESETS["tiny"].hf_config)
    model = build_model(config, "cpu", torch.float32, "dummy", seed=3)
    if products == "dense":  # the fused forwards over F.linear
        fuse_cpu_modules(model)
    elif products == "onednn":  # as the runner runs it
        assert apply_fast_paths(model, "cpu", torch.float32).packed_weights > 0
    spans = [(0, 37), (0, 300), (0, 5)]
    full, full_pages = _forward(model, config, spans, None)
    for rows in ([36], [36, 336, 341], [0, 100, 341], []):
        index = torch.tensor(rows, dtype=torch.long)
        got, pages = _forward(model, config, spans, index)
        assert got.shape == (len(rows), config.hidden_size)
        assert torch.equal(got, full.index_select(0, index)), rows
        assert torch.equal(pages, full_pages)
