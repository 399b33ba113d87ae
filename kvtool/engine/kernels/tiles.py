"""What the GEMM kernels share: the grouped order of output tiles, the device's SM count, and the
tile counters of products whose K is split over programs."""

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


# Tile counters of split products, per device; each tile's counter is back at 0 after its product.
_COUNTERS = 1 << 14
_counters: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's int32 tile counters (all zero between products), enough for `tiles` tiles."""
    if tiles > _COUNTERS:
        raise ValueError(f"{tiles} tiles of a split product, more than the {_COUNTERS} counters")
    if device not in _counters:
        _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def split_launch(m: int, n: int, tiles: int, split: int, parallel_rows: int, out: torch.Tensor,
                 slots: int | None = None) -> tuple[int, torch.Tensor, torch.Tensor, bool]:
    """(programs, float32 partials [slots, m, n], tile counters, parallel) of an [m, n] product of
    `tiles` output tiles whose K is split in `split` parts (`slots` partials, by default one per
    part): up to `parallel_rows` rows each part has programs of its own; otherwise one program per
    tile and the partials and counters are `out` (not read)."""
    if split == 1 or m > parallel_rows:
        return tiles, out, out, False
    parts = torch.empty((slots or split, m, n), dtype=torch.float32, device=out.device)
    return tiles * split, parts, tile_counters(out.device, tiles), True
