"""Attention on CPU through torch's flash-attention CPU kernel, with rows that never depend on
what they are computed with.

The kernel (`aten._scaled_dot_product_flash_attention_for_cpu`) walks the keys in blocks of 512
with an online softmax, and hands each block to BLAS in tiles of query rows. A query row's bits
then depend on three things only, which this module fixes:

* **its keys**: a row at absolute position p always attends the same number of keys,
  `key_length(p)` (p + 1 rounded up to 64 below KEY_BLOCK, to 256 from there),
  padded with zeros past the context and masked past p. The kernel then splits them into the
  same blocks and runs the softmax and P @ V reductions over the same lengths, whatever the
  context length of the step, the chunk the row is in, or the size of a prefix hit.
* **the tile of rows BLAS sees**: BLAS computes few rows with other kernels than many (1 to 3
  on AVX2 machines; 1 to 15 on AVX-512 and AMX ones, whose small-row kernels round
  differently), so every prefill call gets a row count that is a multiple of ROW_MULTIPLE
  (padded with zero rows); the kernel's tiles (32, 64 or 256 rows and the tail) are then
  multiples of it too. Inside this kernel fewer rows round otherwise: how few depends on the
  CPU and the head size (one or two rows at head size 64 on AVX-512 machines, up to four at 96
  and 128), so a decode call, whose rows are query heads, is padded to a multiple of
  `decode_row_multiple(head_dim, dtype)`, found once per process by comparing the kernel's rows
  against a 64-row tile's.
* **the batch**: each (batch, head, row tile) item is computed alone, one thread each, so a
  sequence's rows come out the same whatever else is in the call.

Prefill rows go through in tiles of the rows with one key length (64 positions below KEY_BLOCK,
256 from there: close to causal cost), with the grouped-query heads of one KV head as the
batch dimension, so q, K and V are views. Decode rows (one new token) are batched: sequences
whose last row has the same key length share one call, a sequence's query heads of one KV head
as its rows.
`tests/engine/kernels/attention/test_cpu_identity.py` checks tokens and logprobs bit for bit end to end.

A sliding-window layer (`window` W) reads the same keys and adds the window to the mask: keys at
or before p - W are masked for the row at p. The mask still depends on the row's position alone,
so the rows keep their bits wherever they are computed. A soft-capped layer (`softcap`, Gemma 2)
cannot use the flash kernel: it runs the same tiles through BLAS products, the cap, the mask and
a float32 softmax (transformers' eager order), its decode rows padded to ROW_MULTIPLE like the
prefill tiles, so a row's products see the same row counts either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.engine.kernels.attention.context import AttentionMetadata, SeqSpan
from kvtool.engine.kv.pages import KVPages

KEY_BLOCK = 512  # the CPU flash kernel's key block (kv_split_size)
# Key-length steps below KEY_BLOCK and from there (multiples of every CPU vector width). Finer
# steps waste fewer masked keys; coarser ones put more decode sequences into one call.
SHORT_STEP, LONG_STEP = 64, 256
ROW_MULTIPLE = 16  # BLAS row (column) counts below 16 can take other code paths
# A decode call's rows are one KV head's query heads, padded to the smallest of these whose
# every multiple gives a 64-row tile's bits (not to ROW_MULTIPLE when a smaller one does: the
# flash kernel's exponentials run on every padded row, and decode is most of a long run). At
# least 4: AVX2 BLAS differs up to 3 rows in the model's GEMMs.
DECODE_ROW_MULTIPLES = (4, 8, ROW_MULTIPLE)
_decode_multiples: dict[tuple[int, torch.dtype], int] = {}
_PLAN_KEY = "cpu_flash_plan"


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def decode_row_multiple(head_dim: int, dtype: torch.dtype) -> int:
    """The row multiple of a decode call for this head size and dtype on this CPU: the smallest
    of DECODE_ROW_MULTIPLES whose every multiple up to 64 rows gives each row the bits it has in
    a 64-row tile, over one key block and over several (ROW_MULTIPLE itself always does: the
    prefill tiles are its multiples). Measured once per process."""
    key = (head_dim, dtype)
    if key not in _decode_multiples:
        g = torch.Generator().manual_seed(head_dim)
        found = ROW_MULTIPLE
        cases = []
        for num_keys in (128, KEY_BLOCK + 64):
            q, k, v = (torch.randn((1, 1, n, head_dim), generator=g).to(dtype) for n in (64, num_keys, num_keys))
            mask = _causal_mask(torch.arange(num_keys - 64, num_keys), num_keys, dtype)[None, None]
            cases.append((q, k, v, mask, _flash(q, k, v, mask, head_dim**-0.5)))
        for m in DECODE_ROW_MULTIPLES[:-1]:
            if all(torch.equal(_flash(q[:, :, :n], k, v, mask[:, :, :n], head_dim**-0.5), whole[:, :, :n])
                   for q, k, v, mask, whole in cases for n in range(m, 64, m)):
                found = m
                break
        _decode_multiples[key] = found
    return _decode_multiples[key]


def key_length(position: int) -> int:
    """Keys a row at absolute `position` attends, padding included; also the end (exclusive) of
    the positions that share that length."""
    step = SHORT_STEP if position < KEY_BLOCK else LONG_STEP
    return (position // step + 1) * step


@dataclass(slots=True)
class _Tile:
    row_lo: int  # first row inside the sequence's new tokens
    num_rows: int
    num_padded: int  # num_rows rounded up to ROW_MULTIPLE
    num_keys: int
    mask: torch.Tensor  # [1, 1, num_padded, num_keys]: 0 where visible, -inf elsewhere
    positions: torch.Tensor  # [num_padded]: each row's position (padding rows repeat the last)
    windowed: dict[int, torch.Tensor]  # window -> `mask` with that window, made once per step


@dataclass(slots=True)
class _Prefill:
    seq: SeqSpan
    start: int  # first new position (tokens before it are read from the pages)
    prefix_blocks: torch.Tensor | None  # page blocks covering [0, start)
    keys: torch.Tensor  # [L, Hkv, D], reused by every layer; zero past the context
    values: torch.Tensor
    tiles: list[_Tile]


@dataclass(slots=True)
class _DecodeGroup:
    rows: torch.Tensor  # [B] long: rows of q
    out_rows: torch.Tensor  # [B] long: rows of the result (`rows`, or 0..B-1 for `cpu_flash_rows`)
    block_table: torch.Tensor  # [B * L / block_size] long, 0 past each sequence's blocks
    past_context: torch.Tensor  # flat slots (of [B * L]) at or past each context: zeroed after the gather
    mask: torch.Tensor  # [B, 1, 1, L]
    positions: torch.Tensor  # [B]: each row's position
    windowed: dict[int, torch.Tensor]  # window -> `mask` with that window
    num_keys: int  # L (the buffers may hold a few more: whole pages)
    queries: torch.Tensor  # [B, Hkv, padded group size, D], zero past the group's heads
    keys: torch.Tensor  # [B, L, Hkv, D]
    values: torch.Tensor
    # The same, padded to ROW_MULTIPLE rows for soft-capped layers (made at their first use).
    capped_queries: torch.Tensor | None = None


@dataclass(slots=True)
class _Plan:
    prefills: list[_Prefill]
    decodes: list[_DecodeGroup]


def _windowed(mask: torch.Tensor, positions: torch.Tensor, window: int | None,
              cache: dict[int, torch.Tensor]) -> torch.Tensor:
    """`mask` ([1, 1, R, K] or [B, 1, 1, K], rows at `positions`) with the keys at or before
    position - window masked too; the mask itself without a window."""
    if window is None:
        return mask
    if window not in cache:
        keys = torch.arange(mask.shape[-1], device=mask.device)
        outside = (keys[None, :] <= positions[:, None] - window).view(mask.shape)
        cache[window] = mask.masked_fill(outside, float("-inf"))
    return cache[window]


def _causal_mask(positions: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    keys = torch.arange(num_keys, device=positions.device)
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    ninf = torch.full((), float("-inf"), dtype=dtype, device=positions.device)
    return torch.where(keys[None, :] <= positions[:, None], zero, ninf)


# A prefill tile's mask depends on (first position, rows, padded rows, keys) only, and prompts
# keep meeting the same tiles: masks up to _MASK_CACHE_ELEMENTS are kept (read-only), at most
# _MASK_CACHE_ENTRIES of them (about 64 MiB of float32 at most).
_MASK_CACHE_ELEMENTS, _MASK_CACHE_ENTRIES = 256 * 1024, 64
_tile_masks: dict[tuple, torch.Tensor] = {}


def _tile_mask(lo: int, hi: int, num_padded: int, num_keys: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """[1, 1, num_padded, num_keys] mask of the rows at positions [lo, hi) (padding rows repeat
    the last) over num_keys keys."""
    key = (lo, hi, num_padded, num_keys, dtype, dev)
    mask = _tile_masks.get(key)
    if mask is None:
        pos = torch.arange(lo, lo + num_padded, device=dev).clamp_(max=hi - 1)
        mask = _causal_mask(pos, num_keys, dtype)[None, None]
        if num_padded * num_keys <= _MASK_CACHE_ELEMENTS:
            if len(_tile_masks) >= _MASK_CACHE_ENTRIES:
                _tile_masks.pop(next(iter(_tile_masks)))
            _tile_masks[key] = mask
    return mask


def _plan(meta: AttentionMetadata, q: torch.Tensor) -> _Plan:
    g = meta.kv_pages.geometry
    bs = g.block_size
    dev, dtype = q.device, q.dtype
    hkv, d = g.num_kv_heads, g.head_dim
    group = q.shape[1] // hkv
    prefills: list[_Prefill] = []
    by_length: dict[int, list[SeqSpan]] = {}
    for s in meta.seqs:
        if s.q_len == 1:
            by_length.setdefault(key_length(s.ctx_len - 1), []).append(s)
            continue
        start = s.ctx_len - s.q_len
        n_keys = key_length(s.ctx_len - 1)
        tiles = []
        lo = start
        while lo < s.ctx_len:
            hi = min(key_length(lo), s.ctx_len)
            n, n_pad = hi - lo, _round_up(hi - lo, ROW_MULTIPLE)
            positions = torch.arange(lo, lo + n_pad, device=dev).clamp_(max=hi - 1)
            tiles.append(_Tile(lo - start, n, n_pad, key_length(lo), _tile_mask(lo, hi, n_pad, key_length(lo), dtype, dev),
                               positions, {}))
            lo = hi
        # What the pages hold before the step; an fp8 cache's rows read every key from the pages.
        stored = s.ctx_len if meta.kv_pages.quantized else start
        prefix = s.block_ids[: -(-stored // bs)] if stored else None
        # Whole pages fit (a block may be longer than KEY_BLOCK); flash reads num_keys of them.
        length = _round_up(n_keys, bs)
        prefills.append(_Prefill(
            seq=s, start=start, prefix_blocks=prefix,
            keys=torch.zeros((length, hkv, d), dtype=dtype, device=dev),
            values=torch.zeros((length, hkv, d), dtype=dtype, device=dev),
            tiles=tiles,
        ))
    return _Plan(prefills, _decode_groups(by_length, g, dev, dtype, group))


def _decode_groups(by_length: dict[int, list[SeqSpan]], g, dev: torch.device, dtype: torch.dtype,
                   group: int, out_rows: list[int] | None = None) -> list[_DecodeGroup]:
    """One group per key length of one-row spans (their row: q_start; their position:
    ctx_len - 1); `out_rows` (by span, in by_length's order) places the results elsewhere."""
    bs, hkv, d = g.block_size, g.num_kv_heads, g.head_dim
    decodes = []
    at = 0
    for n_keys, seqs in sorted(by_length.items()):
        width = -(-n_keys // bs)
        table = torch.zeros((len(seqs), width), dtype=torch.long, device=dev)
        for i, s in enumerate(seqs):
            table[i, : s.block_ids.numel()] = s.block_ids
        ctx = torch.tensor([s.ctx_len for s in seqs], device=dev)
        slots = torch.arange(width * bs, device=dev)
        past = (slots[None, :] >= ctx[:, None]).view(-1).nonzero().view(-1)
        b = len(seqs)
        rows = torch.tensor([s.q_start for s in seqs], dtype=torch.long, device=dev)
        decodes.append(_DecodeGroup(
            rows=rows,
            out_rows=rows if out_rows is None else torch.tensor(out_rows[at : at + b], dtype=torch.long, device=dev),
            block_table=table.view(-1),
            past_context=past,
            mask=_causal_mask(ctx - 1, n_keys, dtype)[:, None, None, :],
            positions=ctx - 1,
            windowed={},
            num_keys=n_keys,
            queries=torch.zeros((b, hkv, _round_up(group, decode_row_multiple(d, dtype)), d), dtype=dtype, device=dev),
            keys=torch.empty((b, width * bs, hkv, d), dtype=dtype, device=dev),
            values=torch.empty((b, width * bs, hkv, d), dtype=dtype, device=dev),
        ))
        at += b
    return decodes


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float | None = None) -> torch.Tensor:
    if softcap is not None:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap + mask
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    return out


def cpu_flash_attention(
    meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the packed queries q [T, Hq, D] (T may exceed the step's tokens: rows past
    them are padding and come back zero) over each sequence's keys: the pages for what came
    before this step, k and v [T, Hkv, D] for the new tokens (in an fp8 cache, the pages for
    those too: every row attends the stored values, as after a prefix hit). The new tokens' K/V
    must already be in the pages. `window`: the layer's sliding window, or None; `softcap`: its score cap, or
    None. Returns [T, Hq, D]."""
    plan = meta.extra.get(_PLAN_KEY)
    if plan is None:
        plan = meta.extra[_PLAN_KEY] = _plan(meta, q)
    pages = meta.kv_pages
    bs = pages.geometry.block_size
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    out = torch.zeros_like(q) if t > sum(s.q_len for s in meta.seqs) else torch.empty_like(q)
    for p in plan.prefills:
        s = p.seq
        keys, values = p.keys, p.values
        if p.prefix_blocks is not None:
            n = p.prefix_blocks.numel() * bs
            shape = (p.prefix_blocks.numel(), bs, hkv, d)
            pages.select(layer, 0, p.prefix_blocks, keys[:n].view(shape))
            pages.select(layer, 1, p.prefix_blocks, values[:n].view(shape))
            if n > s.ctx_len:  # a chunk ending inside the prefix's last block: unwritten slots
                keys[s.ctx_len : n] = 0
                values[s.ctx_len : n] = 0
        if not pages.quantized:  # an fp8 cache's rows attend the stored values (its prefix reaches ctx_len)
            keys[p.start : s.ctx_len] = k[s.q_start : s.q_start + s.q_len]
            values[p.start : s.ctx_len] = v[s.q_start : s.q_start + s.q_len]
        for tile in p.tiles:
            lo = s.q_start + tile.row_lo
            rows = q[lo : lo + tile.num_rows]
            if tile.num_padded != tile.num_rows:
                rows = torch.cat([rows, rows.new_zeros((tile.num_padded - tile.num_rows, hq, d))])
            # [G, Hkv, R, D]: query head h * G + g of KV head h is batch g.
            q4 = rows.view(tile.num_padded, hkv, group, d).permute(2, 1, 0, 3)
            k4 = keys[: tile.num_keys].permute(1, 0, 2).unsqueeze(0).expand(group, hkv, tile.num_keys, d)
            v4 = values[: tile.num_keys].permute(1, 0, 2).unsqueeze(0).expand(group, hkv, tile.num_keys, d)
            o = _flash(q4, k4, v4, _windowed(tile.mask, tile.positions, window, tile.windowed), scale, softcap)  # [G, Hkv, R, D]
            out[lo : lo + tile.num_rows] = o[:, :, : tile.num_rows].permute(2, 1, 0, 3).reshape(tile.num_rows, hq, d)
    _run_decodes(plan.decodes, pages, layer, q, out, scale, window, softcap)
    return out


def _run_decodes(groups: list[_DecodeGroup], pages: KVPages, layer: int, q: torch.Tensor,
                 out: torch.Tensor, scale: float, window: int | None, softcap: float | None = None) -> None:
    geo = pages.geometry
    bs, hkv, d = geo.block_size, geo.num_kv_heads, geo.head_dim
    hq = q.shape[1]
    group = hq // hkv
    for g in groups:
        b, n_keys = g.keys.shape[0], g.num_keys
        shape = (g.block_table.numel(), bs, hkv, d)
        pages.select(layer, 0, g.block_table, g.keys.view(shape))
        pages.select(layer, 1, g.block_table, g.values.view(shape))
        # Slots past a context hold whatever the pages had there (maybe not even numbers).
        g.keys.view(-1, hkv * d).index_fill_(0, g.past_context, 0)
        g.values.view(-1, hkv * d).index_fill_(0, g.past_context, 0)
        queries = g.queries
        if softcap is not None:  # the products see the prefill tiles' row counts
            if g.capped_queries is None:
                g.capped_queries = g.queries.new_zeros((b, hkv, _round_up(group, ROW_MULTIPLE), d))
            queries = g.capped_queries
        queries[:, :, :group] = q.index_select(0, g.rows).view(b, hkv, group, d)
        k4, v4 = g.keys[:, :n_keys].transpose(1, 2), g.values[:, :n_keys].transpose(1, 2)
        o = _flash(queries, k4, v4, _windowed(g.mask, g.positions, window, g.windowed), scale, softcap)  # [B, Hkv, Gp, D]
        out.index_copy_(0, g.out_rows, o[:, :, :group].reshape(b, hq, d))


def cpu_flash_rows(meta: AttentionMetadata, layer: int, q: torch.Tensor, rows: torch.Tensor, scale: float,
                   window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of the query rows `rows` ([S] long, rows of q [T, Hq, D]) only, each as a decode
    row at its position (the bits it has in any prefill tile, `_plan`'s invariant). The step's
    K/V must already be in the pages. Returns [S rounded up to ROW_MULTIPLE, Hq, D], zero past S."""
    g = meta.kv_pages.geometry
    by_length: dict[int, list[SeqSpan]] = {}
    order: dict[int, list[int]] = {}
    for i, r in enumerate(rows.tolist()):
        s = next(s for s in meta.seqs if s.q_start <= r < s.q_start + s.q_len)
        ctx = s.ctx_len - s.q_len + (r - s.q_start) + 1
        n_keys = key_length(ctx - 1)
        by_length.setdefault(n_keys, []).append(
            SeqSpan(q_start=r, q_len=1, ctx_len=ctx, block_ids=s.block_ids[: -(-ctx // g.block_size)]))
        order.setdefault(n_keys, []).append(i)
    out_rows = [i for n in sorted(order) for i in order[n]]
    groups = _decode_groups(by_length, g, q.device, q.dtype, q.shape[1] // g.num_kv_heads, out_rows)
    out = q.new_zeros((_round_up(rows.numel(), ROW_MULTIPLE), *q.shape[1:]))
    _run_decodes(groups, meta.kv_pages, layer, q, out, scale, window, softcap)
    return out
