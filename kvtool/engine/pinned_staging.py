"""Pinned host buffers for the CUDA steps' packed inputs, kept from step to step.

Each CUDA step copies its packed inputs to the device once (`runner.pack_step`). Pinning a
fresh host array for every step goes through the pinned-memory allocator, whose cost varies
with what it holds (on an H200 machine 1.3 to 8.3 ms of host time for a 32k full hit's 132 KB,
all of it before the first load is queued). Two grow-only buffers serve the steps in turn; a
buffer is refilled only once the copy out of it, two steps earlier, is done, so a step queued
before the previous one ran (async scheduling) never overwrites inputs still to be copied.
"""

from __future__ import annotations

import numpy as np
import torch

MIN_INT32 = 4096


class PinnedStaging:
    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def to_device(self, host: np.ndarray, device: torch.device) -> torch.Tensor:
        """A copy of the int32 array `host` on `device`, queued on the current stream through
        the next buffer (after waiting for that buffer's previous copy)."""
        i = self._turn
        self._turn ^= 1
        if self._copied[i] is not None:
            self._copied[i].synchronize()
        n = host.size
        buf = self._buffers[i]
        if buf is None or buf.numel() < n:
            size = max(n, MIN_INT32, 0 if buf is None else 2 * buf.numel())
            buf = self._buffers[i] = torch.empty(size, dtype=torch.int32, pin_memory=True)
        staged = buf[:n]
        staged.numpy()[:] = host
        out = staged.to(device, non_blocking=True)
        event = self._copied[i] = self._copied[i] or torch.cuda.Event()
        event.record()
        return out
