"""A CUDA step's inputs on the host: the decode rows the decode graphs and kernels read, and the one
int32 buffer an eager step's inputs travel to the device in.

A model with several KV cache groups (`kv.groups`) has a block table per group. Its groups'
decode rows share the token, the position and the context length; each group has its own slot
(where the new token's K/V go in that group's block) and its own table, and each group gets its
own `DeviceBatch` over the shared index tensors (`PackedStep.group_batches`). The layers attend
with their group's (`AttentionMetadata.for_layer`).

A sliding-window group's tables hold the null block where its window no longer reaches
(`below_window`): the scheduler may have freed those blocks and given them to another request.
The kernels never weigh a key outside the window, so this changes no bit; it keeps every read
inside blocks the request holds, as vLLM's null block does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvtool.engine.core.block_pool import NULL_BLOCK
from kvtool.engine.core.messages import ScheduledRequest
from kvtool.engine.kernels.attention import DeviceBatch, PrefillBatch
from kvtool.engine.kernels.attention.context import longest_first, tile_bases
from kvtool.engine.worker.pinned_staging import PinnedStaging

# int32 entries per 16 bytes: where each segment of a packed step starts (`pack_step`).
SEGMENT_ALIGN = 4


@dataclass(slots=True)
class PackedStep:
    """One eager CUDA step's device inputs, all views into one int32 tensor copied in at once."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    batch: DeviceBatch
    sample_rows: torch.Tensor  # [S]: rows of the sampled sequences (decode ones first)
    written_blocks: np.ndarray  # page blocks this step writes, every group's
    # Every KV cache group's batch, group 0's (`batch`) first; None with one group.
    group_batches: list[DeviceBatch] | None = None


@dataclass(slots=True)
class GroupInputs:
    """One more KV cache group's share of a step: its decode rows (`decode_rows` over its tables)
    and its prefill sequences' tables."""

    rows: np.ndarray
    tables: list[np.ndarray]


def below_window(table: np.ndarray, start: int, window: int | None, block_size: int) -> np.ndarray:
    """`table` with the null block in the blocks that a row at position `start` or later no longer
    sees through a sliding window of `window` keys (None: `table` itself)."""
    if window is None:
        return table
    n = (start - window + 1) // block_size
    if n <= 0:
        return table
    out = table.copy()
    out[:n] = NULL_BLOCK
    return out


def decode_rows(decode: list[ScheduledRequest], tables: list[np.ndarray], block_size: int,
                window: int | None = None) -> np.ndarray:
    """[B, 4 + w] int32 rows for one-token sequences: token, position, slot, context length,
    then the block table up to the longest context (w blocks). `window`: the group's sliding
    window; the table then holds the null block below it (`below_window`)."""
    bs = block_size
    nd = len(decode)
    ctx = np.fromiter((s.start + 1 for s in decode), dtype=np.int64, count=nd)
    width = int(-(-ctx.max() // bs)) if nd else 0
    rows = np.zeros((nd, 4 + width), dtype=np.int32)
    if nd:
        rows[:, 0] = [s.token_ids[0] for s in decode]
        rows[:, 1] = ctx - 1
        rows[:, 3] = ctx
        for i, t in enumerate(tables):
            n = -(-int(ctx[i]) // bs)
            rows[i, 4 : 4 + n] = t[:n]
        last = ctx - 1
        rows[:, 2] = rows[np.arange(nd), 4 + last // bs] * bs + last % bs
        if window is not None:
            hidden = (ctx - window) // bs  # whole blocks below the window of position ctx - 1
            rows[:, 4:][np.arange(width)[None, :] < hidden[:, None]] = NULL_BLOCK
    return rows


def _slots(rows: np.ndarray, prefill: list[ScheduledRequest], tables: list[np.ndarray], bs: int,
           with_keys: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One group's page slots of the step's new tokens (decode rows first) and, `with_keys`, of
    every prefill sequence's keys."""
    slots, keys = [rows[:, 2]], []
    for s, t in zip(prefill, tables):
        p = np.arange(s.start, s.start + s.num_tokens)
        slots.append(t[p // bs] * bs + p % bs)
        if with_keys:
            k = np.arange(s.start + s.num_tokens)
            keys.append(t[k // bs] * bs + k % bs)
    return slots, keys


def pack_step(
    decode: list[ScheduledRequest],
    rows: np.ndarray,
    prefill: list[ScheduledRequest],
    tables: list[np.ndarray],
    block_size: int,
    device: torch.device,
    num_splits: int,
    tiles: bool = False,
    staging: PinnedStaging | None = None,
    groups: Sequence[GroupInputs] = (),
) -> PackedStep:
    """Pack the decode sequences' rows (from `decode_rows`) and the prefill sequences into one int32 host array,
    copy it to the device once, and return views of it. `rows` and `tables` are KV cache group
    0's; `groups`, those of groups 1.. of a multi-group cache.

    Layout: ids [T] | positions [T] | slots [T] | context lengths [B] | block table [B * w] |
    cu_q [P + 1] | cu_k [P + 1] | cumulative sampled rows [P + 1] | key slots [sum ctx] (only with
    a cached prefix) | sample rows | decode launch order [B] | first tile slot of each decode row
    [B] (only with `tiles`: the batch-invariant decode kernel's) | then per further group: its
    slots [T] | its block table [B * w] | its key slots.

    The batch's `sampled` batch is set when the step computes prefill rows it does not sample
    and samples every decode row: its query rows are then the sample rows, in their order.

    The array goes through `staging`'s pinned buffers when given, else through a new pinned copy.
    """
    bs = block_size
    nd, width = rows.shape[0], rows.shape[1] - 4
    ids, pos = [rows[:, 0]], [rows[:, 1]]
    cu_q, cu_k, cu_s = [0], [0], [0]
    has_prefix = any(s.start > 0 for s in prefill)
    sample_rows = [i for i, s in enumerate(decode) if s.sample]
    for s in prefill:
        ids.append(np.asarray(s.token_ids, dtype=np.int32))
        pos.append(np.arange(s.start, s.start + s.num_tokens))
        cu_q.append(cu_q[-1] + s.num_tokens)
        cu_k.append(cu_k[-1] + s.start + s.num_tokens)
        cu_s.append(cu_s[-1] + s.sample)
        if s.sample:
            sample_rows.append(nd + cu_q[-1] - 1)
    group_slots = [_slots(rows, prefill, tables, bs, has_prefix)]
    group_slots += [_slots(g.rows, prefill, g.tables, bs, has_prefix) for g in groups]
    order = longest_first(rows[:, 3])
    bases, num_tiles = tile_bases(rows[:, 3]) if tiles else (np.zeros(0, dtype=np.int32), 0)
    slots, keys = group_slots[0]
    segments = [ids, pos, slots, [rows[:, 3]], [rows[:, 4:]], [cu_q], [cu_k], [cu_s], keys, [sample_rows], [order],
                [bases]]
    for g, (g_slots, g_keys) in zip(groups, group_slots[1:]):
        segments += [g_slots, [g.rows[:, 4:]], g_keys]
    flat = [np.concatenate([np.asarray(x, dtype=np.int32).reshape(-1) for x in seg] or [np.zeros(0, np.int32)])
            for seg in segments]
    # Every segment starts 16 bytes aligned: Triton specializes kernels on their pointers' alignment,
    # and unaligned views at offsets that vary with the step would compile new variants mid-request.
    starts = np.cumsum([0] + [-(-len(f) // SEGMENT_ALIGN) * SEGMENT_ALIGN for f in flat])
    host = np.zeros(int(starts[-1]), dtype=np.int32)
    for f, at in zip(flat, starts):
        host[at : at + len(f)] = f
    if staging is not None:
        dev = staging.to_device(host, device)
    else:
        dev = torch.from_numpy(host).pin_memory().to(device, non_blocking=True)
    views = [dev[at : at + len(f)] for f, at in zip(flat, starts)]
    d_ids, d_pos, d_slots, d_ctx, d_table, d_cu_q, d_cu_k, d_cu_s, d_keys, d_sample, d_order, d_bases = views[:12]
    sampled_batch = bool(prefill) and len(sample_rows) < nd + cu_q[-1] and all(s.sample for s in decode)

    def group_batch(d_slots: torch.Tensor, d_table: torch.Tensor, d_keys: torch.Tensor) -> DeviceBatch:
        pre = None
        if prefill:
            pre = PrefillBatch(
                q_start=nd,
                cu_q=d_cu_q,
                cu_k=d_cu_k,
                max_q=max(s.num_tokens for s in prefill),
                max_k=max(s.start + s.num_tokens for s in prefill),
                key_slots=d_keys if has_prefix else None,
            )
        batch = DeviceBatch(
            slot_mapping=d_slots,
            num_decode=nd,
            block_table=d_table.view(nd, width),
            context_lens=d_ctx,
            num_splits=num_splits,
            prefill=pre,
            decode_order=d_order,
            tile_base=d_bases if tiles else None,
            num_tiles=num_tiles,
        )
        if sampled_batch:
            batch.sampled = replace(batch, prefill=replace(pre, cu_q=d_cu_s, max_q=1) if cu_s[-1] else None)
        return batch

    batches = [group_batch(d_slots, d_table, d_keys)]
    batches += [group_batch(*views[at : at + 3]) for at in range(12, len(views), 3)]
    written = np.concatenate([x for g_slots, _ in group_slots for x in g_slots]) // bs
    return PackedStep(d_ids, d_pos, batches[0], d_sample, written, batches if groups else None)
