"""CUDA graphs for decode steps: one graph per batch-size bucket, all captured at start-up.

A decode step is a few hundred small kernels; replaying them as one graph removes the host
launch cost of every eager op. Every graph reads one static int32 buffer, one row per sequence:

    static[row] = [token id, position, flat slot, context length, block table ..., first tile
                   slot, launch order, then per KV cache group past the first: its slot, its table ...]

The runner fills the first rows of a bucket and pads the rest (slot -1: nothing is written;
context length 0: the decode kernel writes a zero row), copies them in with one host-to-device
copy from a pinned buffer, and replays; the graph ends with the logits and their argmax, so a
greedy step reads back B token ids and nothing else. The split-KV partition count is fixed per bucket so that a replay stays valid
for any context up to the table width; empty splits exit at once. All graphs share one memory
pool; the logits of a replay are read before the next replay, which is all such sharing needs.

The runner captures every bucket up to the engine's `max_num_seqs` when it starts (`capture_all`),
so no request pays for a capture or for compiling the kernels of a new batch size; the buckets
stop at `max_num_seqs`, since no decode step can hold more sequences.

A model with several KV cache groups (`kv.groups`) has a slot and a table per group in each row
(`cuda_step`: the groups share the rest), and its graphs attend each layer with its group's.

In batch-invariant mode a graph is captured with the row-invariant GEMMs (its metadata's
`row_invariant`, and the logits') and the fixed-tile decode kernel, whose tile slots are sized
for the bucket (`tile_slots`); a batch that needs more (sequences sharing prefix blocks) runs
eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from kvtool.engine.kernels.attention import AttentionMetadata, DeviceBatch, attention_context
from kvtool.engine.kernels.attention.context import longest_first, tile_bases, tile_capacity
from kvtool.engine.kv.pages import KVPages

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
NUM_FIXED = 4  # token id, position, slot, context length


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv_pages: KVPages,
        max_batch: int,
        max_blocks_per_seq: int,
        num_splits_for: Callable[[int, int], int],
        batch_invariant: bool = False,
    ) -> None:
        self.model = model
        self.kv_pages = kv_pages
        self.block_size = kv_pages.geometry.block_size
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_batch = max_batch
        self.width = max_blocks_per_seq
        self.num_splits_for = num_splits_for
        self.batch_invariant = batch_invariant
        self.cache_tokens = kv_pages.num_blocks * self.block_size
        device = kv_pages.device
        # Two more columns after the block table: the first tile slot of each row (batch-invariant
        # decode) and the decode kernel's launch order (longest first); then each further KV cache
        # group's slot and table.
        self.tile_col = NUM_FIXED + self.width
        self.order_col = self.tile_col + 1
        self.layer_group = kv_pages.layout.layer_group
        num_groups = kv_pages.layout.num_groups
        self.group_cols = [self.order_col + 1 + g * (1 + self.width) for g in range(num_groups - 1)]
        cols = self.order_col + 1 + (num_groups - 1) * (1 + self.width)
        self.static = torch.zeros((max_batch, cols), dtype=torch.int32, device=device)
        # Host side of the one copy per replay; reused once the previous copy is done.
        self.host = torch.zeros((max_batch, cols), dtype=torch.int32, pin_memory=True)
        self.host_rows = self.host.numpy()
        self.copied = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (logits, argmax)
        self.replays: dict[int, int] = {}  # bucket -> replays so far
        self.pool = None

    def capture_all(self) -> None:
        """Capture every bucket's graph not captured yet (start-up)."""
        for bucket in self.buckets:
            if bucket not in self.graphs:
                self._capture(bucket)
        torch.cuda.synchronize(self.kv_pages.device)

    def bucket_for(self, batch: int) -> int | None:
        """The smallest captured size that holds `batch` rows, or None when it is too large."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def tile_slots(self, bucket: int) -> int:
        """Tile slots a bucket's graph allocates (batch-invariant decode)."""
        return tile_capacity(bucket, self.width * self.block_size, self.cache_tokens)

    def fits(self, context_lens: np.ndarray) -> bool:
        """Whether a graph can run decode rows of these context lengths."""
        batch = len(context_lens)
        if batch > self.max_batch or -(-int(context_lens.max()) // self.block_size) > self.width:
            return False
        return not self.batch_invariant or tile_bases(context_lens)[1] <= self.tile_slots(self.bucket_for(batch))

    def run(self, rows: np.ndarray, patch: Callable[[torch.Tensor], None] | None = None,
            group_rows: Sequence[np.ndarray] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph for rows [B, NUM_FIXED + w] (int32, w <= width); `group_rows`: those
        of KV cache groups 1.. (`cuda_step.decode_rows` over their tables), with several groups.

        `patch(token_ids)`, when given, rewrites some of the rows' token ids on the device after
        the copy and before the replay (async scheduling's tokens from the previous step).
        Returns (logits [B, V], greedy tokens [B]), both graph memory: read them before the next replay.
        """
        batch, cols = rows.shape
        bucket = self.bucket_for(batch)
        if bucket not in self.graphs:
            self._capture(bucket)
        self.copied.synchronize()
        host = self.host_rows
        host[:batch, :cols] = rows
        host[batch:bucket, :NUM_FIXED] = (0, 0, -1, 0)
        bases, num_tiles = tile_bases(rows[:, 3])
        host[:batch, self.tile_col] = bases
        host[batch:bucket, self.tile_col] = num_tiles
        host[:batch, self.order_col] = longest_first(rows[:, 3])
        host[batch:bucket, self.order_col] = np.arange(batch, bucket, dtype=np.int32)
        w = cols - NUM_FIXED  # table columns of this step
        for c, g_rows in zip(self.group_cols, group_rows):
            host[:batch, c] = g_rows[:, 2]
            host[batch:bucket, c] = -1
            host[:batch, c + 1 : c + 1 + w] = g_rows[:, NUM_FIXED:]
        # Whole rows: one contiguous copy. Columns past a row's context are never read.
        self.static[:bucket].copy_(self.host[:bucket], non_blocking=True)
        self.copied.record()
        if patch is not None:
            patch(self.static[:batch, 0])
        self.graphs[bucket].replay()
        self.replays[bucket] = self.replays.get(bucket, 0) + 1
        logits, tokens = self.outputs[bucket]
        return logits[:batch], tokens[:batch]

    def _capture(self, bucket: int) -> None:
        s = self.static[:bucket]
        s.zero_()
        s[:, [2, *self.group_cols]] = -1  # the warm-up run writes nothing into the pages
        s[:, self.order_col] = torch.arange(bucket, dtype=torch.int32, device=s.device)
        batch = DeviceBatch(
            slot_mapping=s[:, 2],
            num_decode=bucket,
            block_table=s[:, NUM_FIXED : NUM_FIXED + self.width],
            context_lens=s[:, 3],
            num_splits=self.num_splits_for(bucket, self.width * self.block_size),
            decode_order=s[:, self.order_col],
            tile_base=s[:, self.tile_col] if self.batch_invariant else None,
            num_tiles=self.tile_slots(bucket),
        )
        meta = AttentionMetadata(kv_pages=self.kv_pages, seqs=[], slot_block_ids=None, slot_offsets=None,
                                 device_batch=batch, row_invariant=self.batch_invariant)
        if self.group_cols:
            groups = [batch] + [replace(batch, slot_mapping=s[:, c], block_table=s[:, c + 1 : c + 1 + self.width])
                                for c in self.group_cols]
            meta.group_metas = [replace(meta, device_batch=b) for b in groups]
            meta.layer_group = self.layer_group

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            with attention_context(meta):
                hidden = self.model(s[:, 0], s[:, 1])
                # The argmax of the half-precision logits is that of their float32 copy (the
                # conversion is exact), so a greedy step never makes the [B, vocab] float32 copy.
                logits = self.model.compute_logits(hidden, as_float=False, row_invariant=self.batch_invariant)
            return logits, logits.argmax(dim=-1)

        # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = step()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bucket] = graph
        self.outputs[bucket] = out
