"""The CPU flash attention's rows against each other, bit for bit: a sequence's rows computed in
one prefill, as the suffix after a cached prefix, in chunks, one at a time as decode rows, and in
a batch with other sequences, over real KV pages. And against plain causal SDPA, to rounding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvtool.engine.kernels.attention import AttentionMetadata, SeqSpan, attention_context, attend
from kvtool.engine.kernels.attention.cpu_flash import key_length
from kvtool.engine.kv.pages import KVGeometry, KVPages

BS, HKV, GROUP, D = 16, 2, 3, 32
SCALE = D**-0.5


def _pages(num_blocks: int, d: int = D) -> KVPages:
    g = KVGeometry(num_layers=1, num_kv_heads=HKV, head_dim=d, block_size=BS, dtype="float32")
    pages = KVPages(g, num_blocks, torch.device("cpu"))
    pages.tensor.fill_(float("nan"))  # slots never written must never reach a result
    return pages


class Sequence:
    """One sequence's q/k/v for every position, and its blocks (in reverse order) in shared pages."""

    def __init__(self, length: int, first_block: int, seed: int, group: int = GROUP, d: int = D) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(length, HKV * group, d, generator=g)
        self.k = torch.randn(length, HKV, d, generator=g)
        self.v = torch.randn(length, HKV, d, generator=g)
        n = math.ceil(length / BS)
        self.blocks = torch.arange(first_block + n - 1, first_block - 1, -1)


def _step(pages: KVPages, parts: list[tuple[Sequence, int, int]], window: int | None = None,
          softcap: float | None = None) -> list[torch.Tensor]:
    """Compute positions [start, end) of each (sequence, start, end) in one step; their outputs."""
    seqs, qs, ks, vs, blocks, offsets, at = [], [], [], [], [], [], 0
    for s, start, end in parts:
        pos = torch.arange(start, end)
        seqs.append(SeqSpan(q_start=at, q_len=end - start, ctx_len=end, block_ids=s.blocks[: math.ceil(end / BS)]))
        qs.append(s.q[start:end]), ks.append(s.k[start:end]), vs.append(s.v[start:end])
        blocks.append(s.blocks[pos // BS]), offsets.append(pos % BS)
        at += end - start
    meta = AttentionMetadata(kv_pages=pages, seqs=seqs, slot_block_ids=torch.cat(blocks), slot_offsets=torch.cat(offsets))
    with attention_context(meta):
        out = attend(0, torch.cat(qs), torch.cat(ks), torch.cat(vs), SCALE, window=window, softcap=softcap)
    return list(out.split([e - s for _, s, e in parts]))


def test_rows_are_the_same_however_computed():
    length = 1300
    whole = _step(_pages(100), [(seq := Sequence(length, 0, seed=0), 0, length)])[0]
    # After a cached prefix of any size, and in chunks (the prefix comes from the pages).
    for prefix in (16, 512, 777, length - 1):
        pages = _pages(100)
        _step(pages, [(seq, 0, prefix)])
        assert torch.equal(_step(pages, [(seq, prefix, length)])[0], whole[prefix:]), prefix
    pages = _pages(100)
    chunks = [_step(pages, [(seq, a, min(a + 197, length))])[0] for a in range(0, length, 197)]
    assert torch.equal(torch.cat(chunks), whole)
    # One row at a time (decode), batched with 0 to 3 other sequences of other lengths (their
    # last row, recomputed each step over the same keys).
    pages = _pages(300)
    others = [Sequence(n, 100 + 50 * i, seed=i + 1) for i, n in enumerate((3, 600, 90))]
    _step(pages, [(seq, 0, 500)] + [(o, 0, len(o.q) - 1) for o in others])
    for p in range(500, 520):
        got = _step(pages, [(seq, p, p + 1)] + [(o, len(o.q) - 1, len(o.q)) for o in others[: p % 4]])
        assert torch.equal(got[0], whole[p : p + 1]), p


def test_matches_causal_sdpa():
    length = 700
    seq = Sequence(length, 0, seed=5)
    out = _step(_pages(50), [(seq, 0, length)])[0]
    ref = F.scaled_dot_product_attention(
        seq.q.transpose(0, 1), seq.k.transpose(0, 1), seq.v.transpose(0, 1), is_causal=True, scale=SCALE, enable_gqa=True
    ).transpose(0, 1)
    assert torch.allclose(out.view_as(ref), ref, atol=1e-5, rtol=1e-5)


def test_key_lengths_depend_on_the_position_only():
    assert [key_length(p) for p in (0, 63, 64, 511, 512, 767, 768)] == [64, 64, 128, 512, 768, 768, 1024]


@pytest.mark.parametrize("d", [32, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_rows_equal_prefill_rows_at_every_head_size(d, group):
    """A decode call's rows are one KV head's query heads, padded to `decode_row_multiple`: with
    one query head per KV head a single row would take BLAS's one-row path and round otherwise,
    and on some CPUs a few rows more at the larger head sizes (Phi-3's 96, Qwen3's 128)."""
    length = 600
    seq = Sequence(length, 0, seed=7, group=group, d=d)
    whole = _step(_pages(100, d), [(seq, 0, length)])[0]
    pages = _pages(100, d)
    _step(pages, [(seq, 0, 500)])
    for p in range(500, 520):
        assert torch.equal(_step(pages, [(seq, p, p + 1)])[0], whole[p : p + 1]), p


@pytest.mark.parametrize(("window", "softcap"), [(1, None), (24, None), (100, None), (700, None), (None, 0.5),
                                               (100, 0.5)])
def test_windows_and_soft_caps_and_rows_keep_their_bits(window, softcap):
    """A sliding-window layer, a soft-capped one (Gemma 2), both: each row equals attention over
    its last `window` keys with scores tanh(s / c) * c, and is the same computed in one prefill, in
    chunks after a prefix, or as a decode step."""
    length = 600
    seq = Sequence(length, 0, seed=5)
    whole = _step(_pages(100), [(seq, 0, length)], window, softcap)[0]
    pos = torch.arange(length)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    q, k, v = (x.transpose(0, 1).double() for x in (seq.q, seq.k.repeat_interleave(GROUP, 1),
                                                    seq.v.repeat_interleave(GROUP, 1)))
    scores = q @ k.transpose(1, 2) * SCALE
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    ref = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1)
    assert torch.allclose(whole.view(length, -1, D).double(), ref, atol=1e-5)
    pages = _pages(100)
    chunks = [_step(pages, [(seq, a, b)], window, softcap)[0] for a, b in ((0, 200), (200, 517), (517, 518))]
    assert torch.equal(torch.cat(chunks), whole[:518])
    for p in range(518, 530):
        assert torch.equal(_step(pages, [(seq, p, p + 1)], window, softcap)[0], whole[p : p + 1]), p


def test_tile_masks_are_kept_bounded_and_right():
    from kvtool.engine.kernels.attention import cpu_flash

    dev = torch.device("cpu")
    first = cpu_flash._tile_mask(512, 700, 192, 768, torch.float32, dev)
    assert cpu_flash._tile_mask(512, 700, 192, 768, torch.float32, dev) is first
    pos = torch.arange(512, 704).clamp_(max=699)
    assert torch.equal(first, cpu_flash._causal_mask(pos, 768, torch.float32)[None, None])
    for lo in range(0, 64 * (cpu_flash._MASK_CACHE_ENTRIES + 5), 64):
        cpu_flash._tile_mask(lo, lo + 64, 64, lo + 64, torch.float32, dev)
    assert len(cpu_flash._tile_masks) <= cpu_flash._MASK_CACHE_ENTRIES


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (50, None), (None, 0.5), (50, 0.5)])
def test_the_reference_path_takes_windows_and_soft_caps_as_the_flash_path(window, softcap):
    """The reference backend (gather, then SDPA or the eager products) on the same step."""
    from kvtool.engine.kernels.attention.reference import paged_attention_reference

    seq = Sequence(300, 0, seed=9)
    pages = _pages(40)
    flash = _step(pages, [(seq, 0, 300)], window, softcap)[0]
    meta = AttentionMetadata(kv_pages=pages, seqs=[SeqSpan(q_start=0, q_len=300, ctx_len=300, block_ids=seq.blocks)],
                             slot_block_ids=None, slot_offsets=None)
    ref = paged_attention_reference(meta, 0, seq.q, SCALE, window, softcap)
    assert torch.allclose(ref.reshape(flash.shape), flash, atol=1e-5)
