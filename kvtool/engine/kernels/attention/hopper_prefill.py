"""Prefill attention on Hopper (compute capability 9.0), written in Gluon: one producer warp and
two consumer warpgroups, each one's softmax beside matrix products, its own and the other's.

The row contract is `triton_prefill`'s: a program owns BLOCK_M query rows of one head of one
sequence and walks the keys from position 0 in tiles of BLOCK_N = 128 on a grid fixed at
position 0, with the same online softmax in float32 (the scale through one explicit FMA, keys past
a row's position masked to exact zeros). Each consumer warpgroup computes 64 of the rows on its
own, so a row's bits do not depend on BLOCK_M, on the rows beside it or on the calls around it.

What differs is the schedule. The producer warp brings the block's Q once and the K / V tiles
through TMA into a ring of shared-memory slots, and frees the consumers from every load. A K slot
is released as soon as both consumers' S_j has read it and a V slot once their P V has, so with
two slots each load has a whole iteration of the loop to land (a slot released with its V alone
would leave K_{j+2} no time: it is needed right after P_j V_j is done). The two consumers are
separate warpgroups; with PINGPONG they take turns to issue their products (one pair of mbarriers
passes the turn): consumer 1 issues its S_j = Q K_j^T and O += P_{j-1} V_{j-1} right after
consumer 0 has issued its own. On an H200 the turns bought nothing the warp scheduler does not
already get from two independent warpgroups (Qwen3-8B cold 32k was no faster with them), so they
are off; the bits are the same either way. Within a consumer, the softmax of S_j
runs while its own P_{j-1} V_{j-1} does: O is rescaled by tile j-1's factor while S_j runs, before
P_{j-1} V_{j-1} is added (the order of `acc = dot(p, v, acc * alpha)`), and the wait for that
product comes after the softmax. ptxas (CUDA 12.8) schedules such a wait right after the one for
S_j when both sit in one basic block, so the softmax is written out in both arms of the masking
branch and the wait follows their join.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kvtool.engine.kernels.attention.triton_prefill import rows_view

SUB_M = 64  # query rows of one consumer warpgroup: the wgmma M of its 4 warps
BLOCK_N = 128
_SUB_M = gl.constexpr(SUB_M)  # the same, for the kernels
_BLOCK_N = gl.constexpr(BLOCK_N)
HEAD_DIMS = (64, 128)
STAGES = 2  # K / V slots in flight
PINGPONG = False  # whether the two consumers take turns to issue their products (above)
MAX_REGISTERS = 168  # per thread at launch; the partitions then take 24 (producer) and ~240 (consumers)


def usable(q: torch.Tensor) -> bool:
    """Whether this kernel runs a model's prefill rows: Hopper, 16-bit, head size 64 or 128.
    Model-wide facts only, so every prefill row of a model takes the same kernel."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in HEAD_DIMS
            and _capability(q.device) == (9, 0))


_capabilities: dict[int, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = torch.cuda.get_device_capability(index)
    return _capabilities[index]


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale):
    """One tile's step of the online softmax (every product and sum written out, so no compiler
    contracts one copy differently from the other)."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(gl.fma(s, qk_scale, -m_new[:, None]))
    alpha = gl.exp2(m_i - m_new)
    l_i = gl.fma(l_i, alpha, gl.sum(p, 1))
    return p, m_new, l_i, alpha


@gluon.jit
def _softmax_step(s, m_i, l_i, pos, start, full_end, qk_scale, col_layout: gl.constexpr):
    """Fold the scores s of the tile at `start` into the running max and sum; returns the
    tile's probabilities, the new max and sum, and the factor that rescales the output."""
    # The softmax in both arms: with it after the join, ptxas would wait for the consumer's
    # P V product before it (module docstring).
    if start >= full_end:  # a tile past the block's first row: keys past each row's position
        n = start + gl.arange(0, _BLOCK_N, layout=col_layout)
        s = gl.where(pos[:, None] >= n[None, :], s, float("-inf"))
        p, m_new, l_new, alpha = _online_softmax(s, m_i, l_i, qk_scale)
    else:
        p, m_new, l_new, alpha = _online_softmax(s, m_i, l_i, qk_scale)
    return p, m_new, l_new, alpha


@gluon.jit
def _block_tiles(q_len, k_len, m_block, BLOCK_M: gl.constexpr):
    """The block's first row position, the end of the tiles no row of it masks, and its tile count."""
    first_pos = k_len - q_len + m_block * BLOCK_M
    full_end = (first_pos + 1) // _BLOCK_N * _BLOCK_N
    return first_pos, full_end, gl.cdiv(gl.minimum(first_pos + BLOCK_M, k_len), _BLOCK_N)


@gluon.jit
def _consume(bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, half):
    """One consumer warpgroup: rows half * 64 .. + 63 of the block."""
    q_bufs, k_bufs, v_bufs = bufs
    q_ready, k_ready, v_ready, k_empty, v_empty, turns = bars
    TAKE_TURNS: gl.constexpr = turns.type.shape[0] == 2
    h, q_first, q_len, k_len, m_block = scalars
    BLOCK_M: gl.constexpr = _SUB_M * q_bufs.type.shape[0]
    NUM_STAGES: gl.constexpr = k_bufs.type.shape[0]
    D: gl.constexpr = k_bufs.type.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, _BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    first_row = m_block * BLOCK_M + half * _SUB_M
    pos = k_len - q_len + first_row + gl.arange(0, _SUB_M, layout=s_rows)
    first_pos, full_end, n_tiles = _block_tiles(q_len, k_len, m_block, BLOCK_M)

    q_smem = q_bufs.index(half)
    mbarrier.wait(q_ready.index(half), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = gl.zeros((_SUB_M, _BLOCK_N), gl.float32, layout=s_layout)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    m_i = gl.full((_SUB_M, ), float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros((_SUB_M, ), gl.float32, layout=s_rows)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, pos, 0, full_end, qk_scale, gl.SliceLayout(0, s_layout))
    p = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
    acc = gl.zeros((_SUB_M, D), gl.float32, layout=o_layout)
    for j in range(1, n_tiles):
        slot = j % NUM_STAGES
        prev = (j - 1) % NUM_STAGES
        mbarrier.wait(k_ready.index(slot), (j // NUM_STAGES) & 1)
        if TAKE_TURNS:  # consumer 0 issues first (a fresh barrier passes parity 1), then they alternate
            mbarrier.wait(turns.index(half), (j - half) & 1)
        s_next = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), s, use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]  # tile j - 1's factor, before its P V
        mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_STAGES) & 1)
        acc_next = warpgroup_mma(p, v_bufs.index(prev), acc, is_async=True)
        if TAKE_TURNS:
            mbarrier.arrive(turns.index(1 - half), count=1)
        s = warpgroup_mma_wait(1, deps=(s_next, ))  # S_j is done; P_{j-1} V_{j-1} may still run
        mbarrier.arrive(k_empty.index(slot), count=1)  # so K_j's slot may take K_{j + NUM_STAGES}
        p_j, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, pos, j * _BLOCK_N, full_end, qk_scale,
                                             gl.SliceLayout(0, s_layout))
        acc, p = warpgroup_mma_wait(0, deps=(acc_next, p))
        mbarrier.arrive(v_empty.index(prev), count=1)
        p = gl.convert_layout(p_j.to(v_bufs.dtype), p_layout)
    last = (n_tiles - 1) % NUM_STAGES
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // NUM_STAGES) & 1)
    acc = warpgroup_mma(p, v_bufs.index(last), acc, is_async=True)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    mbarrier.arrive(v_empty.index(last), count=1)

    out = acc / gl.convert_layout(l_i, o_rows)[:, None]
    rows = first_row + gl.arange(0, _SUB_M, layout=o_rows)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    offsets = (q_first + rows).to(gl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :]
    gl.store(o_ptr + offsets, out.to(o_ptr.dtype.element_ty), mask=(rows < q_len)[:, None] & (d < D)[None, :])


@gluon.jit
def _second_consumer(descs, bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, k_first, col):
    _consume(bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, 1)


@gluon.jit
def _produce(descs, bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, k_first, col):
    """The producer warp: the block's Q, then K and V tile by tile into the free slots."""
    q_desc, k_desc, v_desc = descs
    q_bufs, k_bufs, v_bufs = bufs
    q_ready, k_ready, v_ready, k_empty, v_empty, turns = bars
    h, q_first, q_len, k_len, m_block = scalars
    CONSUMERS: gl.constexpr = q_bufs.type.shape[0]
    NUM_STAGES: gl.constexpr = k_bufs.type.shape[0]
    D: gl.constexpr = k_bufs.type.shape[2]
    first_pos, full_end, n_tiles = _block_tiles(q_len, k_len, m_block, _SUB_M * CONSUMERS)
    for i in gl.static_range(CONSUMERS):
        mbarrier.expect(q_ready.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_first + (m_block * CONSUMERS + i) * _SUB_M, h * D],
                                        q_ready.index(i), q_bufs.index(i))
    for j in range(n_tiles):
        slot = j % NUM_STAGES
        free = ((j // NUM_STAGES) & 1) ^ 1  # a fresh barrier passes parity 1
        mbarrier.wait(k_empty.index(slot), free)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_first + j * _BLOCK_N, col], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), free)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [k_first + j * _BLOCK_N, col], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _prefill_kernel(q_desc, k_desc, v_desc, o_ptr, cu_q_ptr, cu_k_ptr, qk_scale, stride_ot, stride_oh,
                    GROUP: gl.constexpr, CONSUMERS: gl.constexpr, NUM_STAGES: gl.constexpr,
                    TAKE_TURNS: gl.constexpr):
    h = gl.program_id(0)
    seq = gl.program_id(2)
    q_first = gl.load(cu_q_ptr + seq)
    q_len = gl.load(cu_q_ptr + seq + 1) - q_first
    k_first = gl.load(cu_k_ptr + seq)
    k_len = gl.load(cu_k_ptr + seq + 1) - k_first
    # The longest blocks (the last rows of the longest sequence) start first.
    m_block = gl.cdiv(q_len, _SUB_M * CONSUMERS) - 1 - gl.program_id(1)
    if m_block < 0:
        return
    D: gl.constexpr = k_desc.block_type.shape[1]
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # Two barriers when the consumers take turns, else one unused (the count carries the choice).
    turns = gl.allocate_shared_memory(gl.int64, [2 if TAKE_TURNS else 1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 if TAKE_TURNS else 1):
        mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)

    bufs = (q_bufs, k_bufs, v_bufs)
    bars = (q_ready, k_ready, v_ready, k_empty, v_empty, turns)
    scalars = (h, q_first, q_len, k_len, m_block)
    # Worker partitions share one signature; constants travel in the buffers' shapes.
    workers = ((q_desc, k_desc, v_desc), bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, k_first,
               (h // GROUP) * D)
    first = (bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, 0)
    if CONSUMERS == 2:
        gl.warp_specialize([(_consume, first), (_second_consumer, workers), (_produce, workers)], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(_consume, first), (_produce, workers)], [1], [24])


def _descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """x [T, H, D] as a TMA descriptor of [T, H * D] in tiles of [rows, D]: over x itself when its
    layout allows, else over a contiguous copy."""
    view = rows_view(x)
    if view is None:
        view = rows_view(x.contiguous())
    d = x.shape[-1]
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], dtype)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [rows, d], layout)


def hopper_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    scale: float, out: torch.Tensor,
) -> torch.Tensor:
    """`prefill.prefill_attention` for inputs where `usable(q)`; writes and returns out."""
    t, hq, d = q.shape
    # One consumer when every block has at most 64 rows (decode-sized tails, a full hit's one row).
    consumers = 2 if max_q > SUB_M else 1
    grid = (hq, triton.cdiv(max_q, SUB_M * consumers), cu_q.shape[0] - 1)
    _prefill_kernel[grid](
        _descriptor(q, SUB_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), out, cu_q, cu_k,
        scale * math.log2(math.e), out.stride(0), out.stride(1),
        GROUP=hq // k.shape[1], CONSUMERS=consumers, NUM_STAGES=STAGES, TAKE_TURNS=PINGPONG and consumers == 2,
        num_warps=4,
        maxnreg=MAX_REGISTERS if consumers == 2 else None,
    )
    return out
