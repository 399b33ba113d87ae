"""Host copies of the chunks a step stores, taken without holding the step up.

After the forward, the worker half gathers each newly completed chunk from the pages and hands
the host copies to its PUT thread. On a CUDA engine a plain `.cpu()` of each chunk would copy
into pageable memory, through the driver's bounce buffers, while the step waits: 1.2 GB for an
8k-token prompt of Qwen3-8B. Here each chunk is gathered on the device and copied into a pinned
staging buffer by a copy stream of its own, after its gather; the step goes on at once, and the
PUT thread waits for the copies' event before it sends. A buffer goes back to the pool once
its chunk was sent (or failed). The buffers hold at most `max_bytes` (LMCache's
max_local_cpu_size, 5 GB by default); `reserve` pins the first ones in one allocation when the
engine starts (pinning takes milliseconds per buffer, which a step must not pay), the rest are
allocated as they are first needed. When every buffer is in flight (a store slower than the
steps make chunks), the step's chunks from there on are not
stored, as LMCache stores only the chunks its local CPU memory has room for ("Local cpu memory
under pressure"): a slow store never stalls a step, and a chunk not stored is a miss later,
nothing worse. With `wait` (LMCache's force_store_wait) they are copied the pageable way instead,
the step waiting, and every chunk is stored. On a CPU engine the gathered tensor is the host copy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtool.engine.kv.pages import KVPages

# Bytes of pinned staging buffers, by default: LMCache's default max_local_cpu_size, 5 GB (135 of
# Qwen3-8B's 256-token chunks).
DEFAULT_MAX_BYTES = 5 << 30


@dataclass(slots=True)
class StagedChunks:
    """The host copies of one step's chunks, in the jobs' order, and what to wait for first."""

    hosts: list[torch.Tensor]  # each chunk's KV_2LTD bytes on the host
    ready: torch.cuda.Event | None  # recorded after the staged copies; None: nothing to wait for
    buffers: list[torch.Tensor]  # the pool's buffers the copies took, back to the pool after the PUT

    def wait(self) -> None:
        """Block until every host copy holds its chunk."""
        if self.ready is not None:
            self.ready.synchronize()


class StoreStaging:
    def __init__(self, kv_pages: KVPages, chunk_bytes: int, max_bytes: int = DEFAULT_MAX_BYTES,
                 wait: bool = False) -> None:
        self.kv_pages = kv_pages
        self.chunk_bytes = chunk_bytes  # the bytes of a whole chunk: every buffer holds one
        self.max_buffers = max(1, max_bytes // chunk_bytes)
        self.wait = wait  # no free buffer: the pageable copy, the step waiting (else: not stored)
        self.device = kv_pages.device
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._lock = threading.Lock()  # the PUT thread gives buffers back
        self._stream: torch.cuda.Stream | None = None

    def stage(self, chunks: Sequence[tuple[Sequence[int], int]]) -> StagedChunks:
        """Host copies of the chunks given as (block ids, tokens), in that order, as far as buffers
        are free: without `wait`, `hosts` may be shorter than `chunks` (those after it are not
        stored). A chunk is gathered on the device only when its copy is next, so the device holds
        at most the staged chunks' gathers (until the copy stream has read them) and one more."""
        if self.device.type != "cuda":
            return StagedChunks([self.kv_pages.gather(blocks, "KV_2LTD", n) for blocks, n in chunks], None, [])
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        hosts: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        for blocks, n in chunks:
            # Every buffer in flight: this chunk and those after it are neither gathered nor stored.
            if not self.wait and not self._any_free():
                break
            data = self.kv_pages.gather(blocks, "KV_2LTD", n)
            nbytes = data.numel() * data.element_size()
            buf = self._take(nbytes)
            if buf is None:  # force_store_wait: the pageable copy, the step waiting
                hosts.append(data.cpu())
                continue
            gathered = torch.cuda.Event()
            gathered.record()
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(gathered)
                host = buf[:nbytes].view(data.dtype).view(data.shape)
                host.copy_(data, non_blocking=True)
                data.record_stream(self._stream)  # its memory is not reused before the copy ran
            hosts.append(host)
            buffers.append(buf)
        ready = None
        if buffers:
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return StagedChunks(hosts, ready, buffers)

    def reserve(self, n: int) -> None:
        """Pin up to n buffers now, in one host allocation (a CUDA engine; nothing on CPU)."""
        n = min(n, self.max_buffers - self._allocated)
        if self.device.type != "cuda" or n <= 0:
            return
        block = torch.empty(n * self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
        with self._lock:
            self._free.extend(block[i * self.chunk_bytes : (i + 1) * self.chunk_bytes] for i in range(n))
            self._allocated += n

    def release(self, staged: StagedChunks) -> None:
        """Give a step's buffers back once its PUT has sent (or failed to send) them."""
        with self._lock:
            self._free.extend(staged.buffers)
        staged.buffers = []

    def _any_free(self) -> bool:
        """Whether `_take` would find a buffer (only `stage` takes them; releases only add)."""
        with self._lock:
            return bool(self._free) or self._allocated < self.max_buffers

    def _take(self, nbytes: int) -> torch.Tensor | None:
        if nbytes > self.chunk_bytes:
            return None
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._allocated >= self.max_buffers:
                return None
            self._allocated += 1
        return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
