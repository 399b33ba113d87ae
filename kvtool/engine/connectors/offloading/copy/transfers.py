"""Copies between the CPU tier's pinned pool and CUDA KV pages, on their own streams.

Both sides are block-major, so one engine block of all layers is one contiguous range on each
side, and consecutive blocks that are consecutive on both sides merge into one copy:

    pool  [num_slots * blocks_per_slot, 2, L, bs, H, D]   (flat pool block = slot * bps + i)
    pages [num_blocks,                  2, L, bs, H, D]

A load whose destination blocks are scattered (a copy per 2 MB block costs the copy engine
about a tenth of its rate) goes through two 64 MB device buffers instead: large copies of
consecutive pool blocks on a copy stream, each scattered into the pages on the load stream
while the next copy runs.

Ordering (one compute stream, one load stream with its copy stream, one store stream):

* loads wait for the compute stream (earlier readers of the destination blocks) and for the
  stores already queued (a slot being filled may be loaded in the next step); the compute
  stream then waits for the loads: all at once, or layer l for its group of layers when
  loading layerwise (every load of LAYER_GROUP_LOAD_MIN_BLOCKS blocks or more, `worker`);
* stores wait for the compute stream (the forward that wrote the blocks) and run beside the
  next step; a step that writes a block a store still reads waits for that store first
  (`order_page_writes`), and so do host readers of a slot (the disk writer).

Layerwise loads and saves need a few layers' slice of many blocks, pieces of bs*H*D elements
strided by L. Loads take them through the copy engine as pitched copies (`pitched_copy`: one
transfer per group of `layers_per_copy` consecutive layers and run of consecutive pool blocks,
the group's pieces of a block, contiguous on both sides, its rows), staged and scattered like
whole blocks when the destinations are scattered; the forward's layer l waits for its group
alone, so its kernels run while later groups are still on the way. Groups keep each row at
LOAD_ROW_BYTES or more: rows of a single layer's piece (32 KB on Qwen3-8B) move slower than
whole blocks. Where the driver's pitched copy is not available, and for layerwise saves, a
Triton kernel reads or writes the pieces straight in the pinned pool (mapped into the device's
address space), one launch per layer; it runs on the SMs, beside the forward. A layerwise save of
layer l waits for the compute stream right after layer l wrote its K/V, so the copies run beside
the layers that follow instead of after the step.

A step's own inputs must reach the device before its loads are queued (the runner packs them
first): copies to the device run in the order they were queued, whatever their streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvtool.engine.connectors.offloading.copy import pitched_copy
from kvtool.engine.kv.pages import KVPages
from kvtool.engine.worker.pinned_staging import PinnedStaging

STAGING_BYTES = 64 << 20  # one of two device staging buffers for loads into scattered blocks
# Layerwise loads copy rows of at least this many bytes (whole layers' pieces of a block): on an
# H200, full hits of Qwen3-8B (32 KB pieces) were fastest at 8k and 32k tokens with rows of 3
# layers, against 1, 6 and 9 (docs/benchmarks/, 2026-12-04).
LOAD_ROW_BYTES = 96 << 10


def source_chunks(pairs: list[tuple[int, int]], max_blocks: int) -> list[tuple[int, int, int]]:
    """(first pair index, first source block, count) chunks: consecutive sources, at most max_blocks."""
    chunks: list[tuple[int, int, int]] = []
    for i, (src, _) in enumerate(pairs):
        if chunks:
            at, s, n = chunks[-1]
            if src == s + n and n < max_blocks:
                chunks[-1] = (at, s, n + 1)
                continue
        chunks.append((i, src, 1))
    return chunks


def staging_fills(pairs: list[tuple[int, int]], capacity: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """(first pair index, count, pieces) fills of at most `capacity` consecutive pairs, each piece
    (first source block, offset in the fill, count) a run of consecutive sources: a staging buffer
    takes one fill as a copy per piece and is scattered once, however the sources are spread."""
    fills: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    for at, src, n in source_chunks(pairs, capacity):
        while n:
            if not fills or fills[-1][1] == capacity:
                fills.append((at, 0, []))
            first, k, pieces = fills[-1]
            take = min(n, capacity - k)
            pieces.append((src, k, take))
            fills[-1] = (first, k + take, pieces)
            at, src, n = at + take, src + take, n - take
    return fills


def layer_groups(num_layers: int, per: int) -> list[tuple[int, int]]:
    """[first, end) layer ranges of `per` consecutive layers (the last one may be shorter)."""
    per = max(1, min(per, num_layers))
    return [(l0, min(l0 + per, num_layers)) for l0 in range(0, num_layers, per)]


def coalesce(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs -> (src, dst, count) runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs:
            s, d, n = runs[-1]
            if src == s + n and dst == d + n:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def _split_completed(tickets: list, wait: bool) -> tuple[list, list]:
    """(the leading tickets whose event has completed, the rest) of one stream's tickets in
    queue order; with `wait`, every ticket, once its event has completed."""
    done = 0
    for t in tickets:
        if wait:
            t.event.synchronize()
        elif not t.event.query():
            break  # one stream: later tickets cannot be done before this one
        done += 1
    return tickets[:done], tickets[done:]


@dataclass
class LoadTicket:
    """One step's loads: done when `event` has completed."""

    event: torch.cuda.Event
    start: torch.cuda.Event
    # The load jobs whose copies this ticket carries (their slots are free once it completes).
    job_ids: list[int] = field(default_factory=list)


@dataclass
class StoreTicket:
    """One step's stores: done when `event` has completed."""

    event: torch.cuda.Event
    start: torch.cuda.Event
    page_blocks: np.ndarray  # page blocks the copies read
    num_bytes: int
    # The store jobs whose copies this ticket carries (reported finished once it completes).
    job_ids: list[int] = field(default_factory=list)


class SlotTransfers:
    def __init__(self, pool: torch.Tensor, pages: KVPages) -> None:
        if pages.quantized:  # an fp8 cache's bytes move as uint8 (torch has no index_copy_ of fp8)
            pool = pool.view(torch.uint8)
        # [num_slots * bps, 2, L, bs, H, D]: a view, no copy
        self.pool = pool.view(-1, *pool.shape[2:])
        self.pages = pages
        # The pages as the copies address them: the same bytes, uint8 for an fp8 cache.
        self.page_tensor = pages.tensor.view(torch.uint8) if pages.quantized else pages.tensor
        self.block_bytes = pages.block_bytes
        # The pages' layer dimension: the model's layers, or each KV cache group's slots
        # (`kv.groups`); "layer" below means an index into it.
        self.num_layers = pages.layout.num_slots
        device = pages.device
        # Loads gate the forward (layer by layer when layerwise): their kernels go first.
        self.load_stream = torch.cuda.Stream(device, priority=-1)
        self.store_stream = torch.cuda.Stream(device)
        # Staged loads: host-to-device copies here, scatters into the pages on load_stream.
        self.copy_stream = torch.cuda.Stream(device, priority=-1)
        self.staging: list[torch.Tensor] = []
        self.layer_events: list[torch.cuda.Event] = []
        self.loads: list[LoadTicket] = []  # queued loads, oldest first
        self.stores: list[StoreTicket] = []
        self.last_store: torch.cuda.Event | None = None
        self._layer_store_start: torch.cuda.Event | None = None
        self._layer_copy = None
        self._rows_ok: bool | None = None  # pitched copies work (checked once)
        # Layers per pitched copy in layerwise loads: rows of that many layers' pieces.
        piece_bytes = self.block_bytes // (2 * self.num_layers)
        self.layers_per_copy = max(1, min(self.num_layers, -(-LOAD_ROW_BYTES // piece_bytes)))
        # Index tensors go to the device through reused pinned buffers (pinning a fresh one per
        # load costs milliseconds on the load's critical path).
        self._index_staging = PinnedStaging(torch.int64)

    # ---- loads ---------------------------------------------------------------------------------

    def can_copy_layerwise(self) -> bool:
        """Whether the device can read and write the pinned pool directly (checked once, with tiny copies)."""
        if self._layer_copy is None:
            try:
                from kvtool.engine.connectors.offloading.copy.layer_copy import copy_layer, probe_pinned_access

                self._layer_copy = copy_layer if probe_pinned_access(self.pool, self.page_tensor) else False
            except ImportError:
                self._layer_copy = False
        return bool(self._layer_copy)

    def can_copy_rows(self) -> bool:
        """Whether layerwise loads can go through the copy engine as pitched copies (checked
        once: one layer of one pool block copied into a scratch buffer and compared)."""
        if self._rows_ok is None:
            self._rows_ok = False
            if pitched_copy.available() and self.pool.is_pinned() and self.pool.is_contiguous():
                pages = self.page_tensor
                scratch = torch.empty((2, *pages.shape[3:]), dtype=pages.dtype, device=pages.device)
                piece = scratch[0].numel() * scratch.element_size()
                try:
                    stream = torch.cuda.current_stream(pages.device)
                    pitched_copy.copy_rows_h2d(scratch.data_ptr(), piece, self.pool.data_ptr(),
                                               self.num_layers * piece, piece, 2, stream.cuda_stream)
                    stream.synchronize()
                except pitched_copy.PitchedCopyError:
                    return False
                expected = self.pool[0, :, 0].contiguous().view(torch.uint8)
                self._rows_ok = torch.equal(scratch.cpu().view(torch.uint8), expected)
        return self._rows_ok

    def load(self, pairs: list[tuple[int, int]], layerwise: bool) -> LoadTicket:
        """Queue copies of pool blocks into page blocks, (flat pool block, page block) each.

        The compute stream waits for them before the forward, or per layer (`wait_layer`):
        through the copy engine when `can_copy_rows`, else through the layer kernel.
        """
        compute = torch.cuda.current_stream(self.pages.device)
        ls = self.load_stream
        ls.wait_stream(compute)
        if self.last_store is not None:
            ls.wait_event(self.last_store)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        self.layer_events = []
        pages = self.page_tensor
        with torch.cuda.stream(ls):
            start.record(ls)
            if layerwise and self.can_copy_rows():
                self._load_layers(pairs)
            elif layerwise:
                index = self.device_index(np.asarray(pairs, dtype=np.int64))
                for layer in range(self.num_layers):
                    self._layer_copy(self.pool, pages, index, layer)
                    self._record_layer(ls)
            else:
                runs = coalesce(pairs)
                chunks = source_chunks(pairs, self._staging_blocks())
                if len(chunks) * 4 <= len(runs):
                    self._load_staged(pairs, chunks)
                else:
                    for src, dst, n in runs:
                        pages[dst : dst + n].copy_(self.pool[src : src + n], non_blocking=True)
            end.record(ls)
        if not layerwise:
            compute.wait_event(end)
        ticket = LoadTicket(end, start)
        self.loads.append(ticket)
        return ticket

    def device_index(self, values: np.ndarray) -> torch.Tensor:
        """`values` (int64) on the device, copied on the current stream through reused pinned buffers."""
        return self._index_staging.to_device(values, self.pages.device)

    def _staging_blocks(self) -> int:
        return max(1, STAGING_BYTES // self.block_bytes)

    def _staging_buffers(self) -> list[torch.Tensor]:
        if not self.staging:
            pages = self.page_tensor
            shape = (self._staging_blocks(), *pages.shape[1:])
            self.staging = [torch.empty(shape, dtype=pages.dtype, device=pages.device) for _ in range(2)]
        return self.staging

    def _load_layers(self, pairs: list[tuple[int, int]]) -> None:
        """Layers in groups of `layers_per_copy` through the copy engine: for each group, one
        pitched copy per run of consecutive pool blocks (its rows are the blocks' K and V pieces
        of the group's layers, contiguous on both sides), straight into the pages when the
        destinations are consecutive too, else into the two staging buffers in turn
        (`staging_fills`: a copy per run in the fill) and scattered into the group's slice of
        the pages on the load stream, once per fill. Each layer's event is its group's, recorded
        once the group's pieces are in place."""
        ls, cs = self.load_stream, self.copy_stream
        pages = self.page_tensor
        num_layers = self.num_layers
        groups = layer_groups(num_layers, self.layers_per_copy)
        per = groups[0][1]
        piece_shape = pages.shape[3:]  # (bs, H, D)
        piece = pages[0, 0, 0].numel() * pages.element_size()
        pitch = num_layers * piece
        pool_at, pages_at = self.pool.data_ptr(), pages.data_ptr()

        def row0(base: int, block: int, layer: int) -> int:  # address of (block, K, layer)
            return base + (block * 2 * num_layers + layer) * piece

        runs = coalesce(pairs)
        # A staging buffer holds that many whole blocks, so L // per times as many blocks' pieces of one group.
        capacity = self._staging_blocks() * num_layers // per
        chunks = source_chunks(pairs, capacity)
        if len(chunks) * 4 > len(runs):
            for l0, l1 in groups:
                for src, dst, n in runs:
                    pitched_copy.copy_rows_h2d(row0(pages_at, dst, l0), pitch, row0(pool_at, src, l0), pitch,
                                               (l1 - l0) * piece, 2 * n, ls.cuda_stream)
                self._record_layer(ls, l1 - l0)
            return
        bufs = [b.view(-1) for b in self._staging_buffers()]
        dst = self.device_index(np.fromiter((d for _, d in pairs), dtype=np.int64, count=len(pairs)))
        cs.wait_stream(ls)  # the buffers' last scatters, and everything the load stream waited for
        elems = pages[0, 0, 0].numel()
        fills = staging_fills(pairs, capacity)
        scattered: list[torch.cuda.Event] = []
        for l0, l1 in groups:
            g = l1 - l0
            group_pages = pages[:, :, l0:l1]  # [num_blocks, 2, g, bs, H, D], strided
            for at, n, pieces in fills:
                i = len(scattered)
                buf = bufs[i % 2][: 2 * n * g * elems].view(n, 2, g, *piece_shape)
                if i >= 2:
                    cs.wait_event(scattered[i - 2])
                base = buf.data_ptr()
                for src, k, count in pieces:
                    pitched_copy.copy_rows_h2d(base + 2 * k * g * piece, g * piece, row0(pool_at, src, l0), pitch,
                                               g * piece, 2 * count, cs.cuda_stream)
                copied = torch.cuda.Event()
                copied.record(cs)
                ls.wait_event(copied)
                group_pages.index_copy_(0, dst[at : at + n], buf)
                ev = torch.cuda.Event()
                ev.record(ls)
                scattered.append(ev)
            self._record_layer(ls, g)

    def _record_layer(self, ls: torch.cuda.Stream, layers: int = 1) -> None:
        """One event for the next `layers` layers, recorded now on `ls`."""
        ev = torch.cuda.Event()
        ev.record(ls)
        self.layer_events.extend([ev] * layers)

    def _load_staged(self, pairs: list[tuple[int, int]], chunks: list[tuple[int, int, int]]) -> None:
        """Pages whose destination blocks are scattered: large copies of consecutive pool blocks
        into two device buffers in turn, each scattered into the pages on the load stream while
        the next copy runs (a copy per 2 MB block would run at the copy engine's per-piece cost)."""
        ls, cs = self.load_stream, self.copy_stream
        pages = self.page_tensor
        self._staging_buffers()
        dst = self.device_index(np.fromiter((d for _, d in pairs), dtype=np.int64, count=len(pairs)))
        cs.wait_stream(ls)  # the buffers' last scatters, and everything the load stream waited for
        scattered: list[torch.cuda.Event] = []
        for i, (at, src, n) in enumerate(chunks):
            buf = self.staging[i % 2]
            if i >= 2:
                cs.wait_event(scattered[i - 2])
            with torch.cuda.stream(cs):
                buf[:n].copy_(self.pool[src : src + n], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(cs)
            ls.wait_event(copied)
            pages.index_copy_(0, dst[at : at + n], buf[:n])
            ev = torch.cuda.Event()
            ev.record(ls)
            scattered.append(ev)

    def wait_layer(self, layer: int) -> None:
        if self.layer_events:
            torch.cuda.current_stream(self.pages.device).wait_event(self.layer_events[layer])

    def completed_loads(self, wait: bool = False) -> list[LoadTicket]:
        """Remove and return the load tickets whose copies are done (all of them when `wait`):
        their slots may then be reused. The host does not wait for a step's loads unless asked,
        so it keeps scheduling ahead of the device while they run."""
        done, self.loads = _split_completed(self.loads, wait)
        return done

    # ---- stores --------------------------------------------------------------------------------

    def store(self, pairs: list[tuple[int, int]]) -> StoreTicket:
        """Queue copies of page blocks into pool blocks, (page block, flat pool block) each,
        after the compute stream's work so far."""
        compute = torch.cuda.current_stream(self.pages.device)
        ss = self.store_stream
        ss.wait_stream(compute)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        pages = self.page_tensor
        with torch.cuda.stream(ss):
            start.record(ss)
            for src, dst, n in coalesce(pairs):
                self.pool[dst : dst + n].copy_(pages[src : src + n], non_blocking=True)
            end.record(ss)
        ticket = StoreTicket(end, start, np.fromiter((p for p, _ in pairs), dtype=np.int64, count=len(pairs)),
                             len(pairs) * self.block_bytes)
        self.stores.append(ticket)
        self.last_store = end
        return ticket

    def store_layer(self, pairs: list[tuple[int, int]], index: torch.Tensor, layer: int) -> StoreTicket | None:
        """Queue layer `layer` of page blocks into pool blocks, after the compute stream's work
        so far (the layer that just wrote them). `index` is `pairs` on the device ([N, 2] int64).
        The last layer's call returns the ticket of the whole store."""
        compute = torch.cuda.current_stream(self.pages.device)
        ss = self.store_stream
        ss.wait_stream(compute)
        with torch.cuda.stream(ss):
            if layer == 0:
                self._layer_store_start = torch.cuda.Event(enable_timing=True)
                self._layer_store_start.record(ss)
            self._layer_copy(self.page_tensor, self.pool, index, layer)
            if layer < self.num_layers - 1:
                return None
            end = torch.cuda.Event(enable_timing=True)
            end.record(ss)
        ticket = StoreTicket(end, self._layer_store_start,
                             np.fromiter((p for p, _ in pairs), dtype=np.int64, count=len(pairs)),
                             len(pairs) * self.block_bytes)
        self.stores.append(ticket)
        self.last_store = end
        return ticket

    def completed_stores(self, wait: bool = False) -> list[StoreTicket]:
        """Remove and return the store tickets whose copies are done (all of them when `wait`)."""
        done, self.stores = _split_completed(self.stores, wait)
        return done

    def order_page_writes(self, block_ids: np.ndarray) -> None:
        """Make the compute stream wait for queued stores that read any of `block_ids`."""
        last = None
        for t in self.stores:
            if np.isin(t.page_blocks, block_ids, assume_unique=False).any():
                last = t
        if last is not None:
            torch.cuda.current_stream(self.pages.device).wait_event(last.event)
