"""The FP8 product of prefill-sized row counts on Hopper, written in Gluon: one producer warp and
two consumer warpgroups, so that one consumer scales a group's product while the other's runs on
the tensor cores.

The arithmetic is `fp8_gemm`'s, element for element: each K group of 128 columns is one warpgroup
MMA from zero, folded into the running sum in K order with one rounding after the row's activation
scale and the column's weight scale are multiplied (`acc = fma(dot, s_a * s_w, acc)`). So its rows
are the Triton kernel's bits at every row count, and `fp8_mm` picks between the two for speed
alone. What differs is the schedule: in the Triton kernel the warps that wait for a group's product
are the ones that must then scale it, so the tensor cores idle during the scaling; here the
producer warp brings each group's tiles through TMA into a ring of shared-memory slots, and the
two consumers (64 rows each of a 128-row tile) wait, scale and issue independently, each one's
scaling beside the other's product.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kvtool.engine.kernels.fp8_weight import GROUP, Fp8Weight
from kvtool.engine.kernels.gluon import is_hopper

SUB_M = 64  # rows of one consumer warpgroup: the wgmma M of its 4 warps
CONSUMERS = 2
BLOCK_N = 128
STAGES = 4  # K groups in flight: 32 KiB of shared memory each
GROUP_M = 8  # row tiles that walk the column tiles together (`tiles.grouped_tile`)
MAX_REGISTERS = 168  # per thread at launch; the partitions then take 24 (producer) and 240 (consumers)
_SUB_M = gl.constexpr(SUB_M)  # the same, for the kernels


def usable(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether this kernel can run a product of x by w: Hopper, K whole groups, a weight a TMA
    descriptor can describe, and weight scales that are one per K group for a whole column tile
    (blocks BLOCK_N high or more) or one per column for the whole of K."""
    k = w.data.shape[1]
    described = w.data.stride(1) == 1 and w.data.stride(0) % 16 == 0 and w.data.data_ptr() % 16 == 0
    return k % GROUP == 0 and described and (_block_scales(w) or w.scale.shape[1] == 1) and is_hopper(x.device)


def _block_scales(w: Fp8Weight) -> bool:
    return w.scale.shape[1] > 1 and w.scale_rows % BLOCK_N == 0


@gluon.jit
def _produce(descs, bufs, bars, scalars, ptrs):
    """The producer warp: each K group's activation rows (one tile per consumer) and weight rows
    into the next free slot."""
    a_desc, w_desc = descs
    a_bufs, w_bufs, flags = bufs
    ready, empty = bars
    pm, pn, M, N, K = scalars
    NUM_STAGES: gl.constexpr = w_bufs.type.shape[0]
    NUM_CONSUMERS: gl.constexpr = a_bufs.type.shape[0] // NUM_STAGES
    BN: gl.constexpr = w_bufs.type.shape[1]
    BK: gl.constexpr = w_bufs.type.shape[2]
    for i in range(K // BK):
        slot = i % NUM_STAGES
        mbarrier.wait(empty.index(slot), ((i // NUM_STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(ready.index(slot), NUM_CONSUMERS * a_desc.block_type.nbytes + w_desc.block_type.nbytes)
        for c in gl.static_range(NUM_CONSUMERS):
            tma.async_copy_global_to_shared(a_desc, [(pm * NUM_CONSUMERS + c) * _SUB_M, i * BK], ready.index(slot),
                                            a_bufs.index(slot * NUM_CONSUMERS + c))
        tma.async_copy_global_to_shared(w_desc, [pn * BN, i * BK], ready.index(slot), w_bufs.index(slot))


@gluon.jit
def _consume(bufs, bars, scalars, ptrs, half):
    """One consumer warpgroup: rows half * 64 .. + 63 of the tile, every group of K in order."""
    a_bufs, w_bufs, flags = bufs
    ready, empty = bars
    pm, pn, M, N, K = scalars
    as_ptr, s_ptr, c_ptr, stride_as, stride_sn, stride_sk, stride_c, scale_rows, scale_cols = ptrs
    BLOCK_W: gl.constexpr = flags.type.shape[0] == 2
    NUM_STAGES: gl.constexpr = w_bufs.type.shape[0]
    NUM_CONSUMERS: gl.constexpr = a_bufs.type.shape[0] // NUM_STAGES
    BN: gl.constexpr = w_bufs.type.shape[1]
    BK: gl.constexpr = w_bufs.type.shape[2]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)

    rm = (pm * NUM_CONSUMERS + half) * _SUB_M + gl.arange(0, _SUB_M, layout=rows_layout)
    rn = pn * BN + gl.arange(0, BN, layout=cols_layout)
    m_ok = rm < M
    n_ok = rn < N
    as_p = as_ptr + rm.to(gl.int64) * stride_as
    # Block scales: one per K group for the whole tile (its columns lie in one block row); else
    # one per column for the whole of K, loaded once.
    w_row = s_ptr + (pn * BN // scale_rows) * stride_sn
    if not BLOCK_W:
        w_cols = gl.load(s_ptr + (rn // scale_rows) * stride_sn, mask=n_ok, other=0.0)
    acc = gl.zeros((_SUB_M, BN), gl.float32, layout=layout)
    prod = gl.zeros((_SUB_M, BN), gl.float32, layout=layout)
    for i in range(K // BK):
        slot = i % NUM_STAGES
        a_s = gl.load(as_p + i, mask=m_ok, other=0.0)
        if BLOCK_W:
            w_s = gl.load(w_row + (i * BK // scale_cols) * stride_sk)
        mbarrier.wait(ready.index(slot), (i // NUM_STAGES) & 1)
        prod = warpgroup_mma(a_bufs.index(slot * NUM_CONSUMERS + half), w_bufs.index(slot).permute((1, 0)), prod,
                             use_acc=False, is_async=True)
        prod = warpgroup_mma_wait(0, deps=(prod, ))
        mbarrier.arrive(empty.index(slot), count=1)
        # acc = fma(dot, s_a * s_w, acc): the Triton kernel's arithmetic (and cuBLAS's)
        if BLOCK_W:
            acc += prod * (a_s[:, None] * w_s)
        else:
            acc += prod * (a_s[:, None] * w_cols[None, :])
    c_p = c_ptr + rm[:, None].to(gl.int64) * stride_c + rn[None, :]
    gl.store(c_p, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@gluon.jit
def _second_consumer(descs, bufs, bars, scalars, ptrs):
    _consume(bufs, bars, scalars, ptrs, 1)


@gluon.jit
def _fp8_gemm_kernel(a_desc, w_desc, as_ptr, s_ptr, c_ptr, M, N, K, stride_as, stride_sn, stride_sk, stride_c,
                     scale_rows, scale_cols, NUM_STAGES: gl.constexpr, GROUP_TILES: gl.constexpr,
                     BLOCK_W: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0] * 2
    BN: gl.constexpr = w_desc.block_type.shape[0]
    # Grouped tile order (`tiles.grouped_tile`): GROUP_TILES row tiles walk the column tiles together.
    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BM)
    width = GROUP_TILES * gl.cdiv(N, BN)
    first_m = (pid // width) * GROUP_TILES
    group = gl.minimum(tiles_m - first_m, GROUP_TILES)
    pm = first_m + (pid % width) % group
    pn = (pid % width) // group

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES * 2] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)

    # The partitions' arguments arrive as runtime values, so whether the weight has block scales
    # travels in this (unused) buffer's shape: 2 rows for blocks.
    flags = gl.allocate_shared_memory(gl.int8, [2 if BLOCK_W else 1, 1],
                                      gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    bufs = (a_bufs, w_bufs, flags)
    bars = (ready, empty)
    scalars = (pm, pn, M, N, K)
    ptrs = (as_ptr, s_ptr, c_ptr, stride_as, stride_sn, stride_sk, stride_c, scale_rows, scale_cols)
    # Worker partitions share one signature; constants travel in the buffers' shapes.
    workers = ((a_desc, w_desc), bufs, bars, scalars, ptrs)
    gl.warp_specialize([(_consume, (bufs, bars, scalars, ptrs, 0)), (_second_consumer, workers), (_produce, workers)],
                       [4, 1], [240, 24])


def _descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([rows, GROUP], gl.float8e4nv)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, GROUP], layout)


def hopper_fp8_mm(q: torch.Tensor, q_scale: torch.Tensor, w: Fp8Weight, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = `fp8_gemm`'s product of the quantised activations q [M, K] (float8_e4m3fn,
    scales q_scale [M, K / GROUP]) and w; for inputs where `usable`."""
    m, k = q.shape
    n = w.data.shape[0]
    stride_sk = w.scale.stride(1) if w.scale.shape[1] > 1 else 0
    grid = (triton.cdiv(m, SUB_M * CONSUMERS) * triton.cdiv(n, BLOCK_N), )
    _fp8_gemm_kernel[grid](
        _descriptor(q, SUB_M), _descriptor(w.data, BLOCK_N), q_scale, w.scale, out, m, n, k,
        q_scale.stride(0), w.scale.stride(0), stride_sk, out.stride(0), w.scale_rows, w.scale_cols,
        NUM_STAGES=STAGES, GROUP_TILES=GROUP_M, BLOCK_W=_block_scales(w), num_warps=4,
        maxnreg=MAX_REGISTERS)
    return out
