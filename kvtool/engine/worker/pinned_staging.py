"""Pinned host buffers for copies of index arrays to the device, kept from copy to copy.

The CUDA steps copy their packed inputs to the device once each (`runner.pack_step`), and the
CPU tier's loads their destination indices (`SlotTransfers`). Pinning a fresh host array for
every copy goes through the pinned-memory allocator, whose cost varies with what it holds (up to
milliseconds of host time for a 32k full hit's step inputs, all of it before the first load is
queued). Two grow-only buffers serve the copies in turn; a buffer is
refilled only once the copy out of it, two copies earlier, is done, so a copy queued before the
previous one ran (async scheduling) never overwrites data still to be copied.
"""

from __future__ import annotations

import numpy as np
import torch

MIN_ITEMS = 4096  # the smallest buffer, in elements


class PinnedStaging:
    """Copies of arrays of one dtype (`dtype`) to the device through two reused pinned buffers."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def to_device(self, host: np.ndarray, device: torch.device) -> torch.Tensor:
        """A copy of `host` (any shape, of this staging's dtype) on `device`, queued on the current
        stream through the next buffer (after waiting for that buffer's previous copy)."""
        i = self._turn
        self._turn ^= 1
        if self._copied[i] is not None:
            self._copied[i].synchronize()
        n = host.size
        buf = self._buffers[i]
        if buf is None or buf.numel() < n:
            size = max(n, MIN_ITEMS, 0 if buf is None else 2 * buf.numel())
            buf = self._buffers[i] = torch.empty(size, dtype=self.dtype, pin_memory=True)
        staged = buf[:n]
        staged.numpy()[:] = host.reshape(-1)
        out = staged.to(device, non_blocking=True).view(host.shape)
        if self._copied[i] is None:
            self._copied[i] = torch.cuda.Event()
        self._copied[i].record()
        return out
