"""What the GEMM kernels share: the grouped order of output tiles and the device's SM count."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in grouped order: GROUP_M row tiles walk the
    column tiles together, so consecutive programs share weight tiles in the cache."""
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    group = min(tiles_m - first_m, GROUP_M)
    return first_m + (pid % width) % group, (pid % width) // group


_num_sms: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms:
        _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _num_sms[index]
