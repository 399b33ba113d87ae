"""Prefill attention on Hopper (compute capability 9.0), written in Gluon: one producer warp and
two consumer warpgroups, each one's softmax beside matrix products, its own and the other's.

The row contract is `triton_prefill`'s: a program owns BLOCK_M query rows of one head of one
sequence and walks the keys in tiles of BLOCK_N (`triton_prefill.key_tile`: 128, or 64 for
heads of 256) on a grid fixed at position 0, with the same online softmax in float32 (the scale
through one explicit FMA, keys past a row's position masked to exact zeros). Each consumer
warpgroup computes 64 of the rows on its own, so a row's bits do not depend on BLOCK_M, on the
rows beside it or on the calls around it.

A sliding-window layer's block starts at the tile holding its first row's first key and masks
every tile; a row that has seen none of its keys yet keeps exact zeros, so the tiles before its
own window leave no trace. A soft-capped layer's scores become tanh(scale * q.k / cap) * cap
before the masks. A 256-wide head's consumer holds its [64, 256] float32 output in 128 registers
a thread; with 64-key tiles, two slots and two consumers the block fills 192 KiB of shared memory.

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

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kvtool.engine.kernels.attention.triton_ops import qk_factor
from kvtool.engine.kernels.attention.triton_prefill import key_tile, rows_view
from kvtool.engine.kernels.gluon import is_hopper

SUB_M = 64  # query rows of one consumer warpgroup: the wgmma M of its 4 warps
_SUB_M = gl.constexpr(SUB_M)  # the same, for the kernels
HEAD_DIMS = (64, 128, 256)
STAGES = 2  # K / V slots in flight
PINGPONG = False  # whether the two consumers take turns to issue their products (above)
MAX_REGISTERS = 168  # per thread at launch; the partitions then take 24 (producer) and ~240 (consumers)


def usable(q: torch.Tensor) -> bool:
    """Whether this kernel runs a model's prefill rows: Hopper, 16-bit, head size 64, 128 or 256.
    Model-wide facts only, so every prefill row of a layer takes the same kernel."""
    return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in HEAD_DIMS and is_hopper(q.device)


@gluon.jit
def _tanh(x):
    """`triton_ops.tanh`: 1 - 2 / (e^(2x) + 1) through one exp2, never NaN."""
    return 1.0 - 2.0 / (gl.exp2(x * 2.8853900817779268) + 1.0)


@gluon.jit
def _online_softmax(s, m_i, l_i, score_scale, WINDOWED: gl.constexpr):
    """One tile's step of the online softmax (every product and sum written out, so no compiler
    contracts one copy differently from the other). A windowed row that has seen no key yet keeps
    its state: exact zeros and a maximum of -inf."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * score_scale)
    m_use = m_new
    if WINDOWED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(gl.fma(s, score_scale, -m_use[:, None]))
    alpha = gl.exp2(m_i - m_use)
    l_i = gl.fma(l_i, alpha, gl.sum(p, 1))
    return p, m_new, l_i, alpha


@gluon.jit
def _softmax_step(s, m_i, l_i, pos, start, full_end, qk_scale, col_layout: gl.constexpr, layer,
                  WINDOWED: gl.constexpr, CAPPED: gl.constexpr):
    """Fold the scores s of the tile at `start` into the running max and sum; returns the
    tile's probabilities, the new max and sum, and the factor that rescales the output.
    A soft-capped layer's scores become tanh(s * qk_scale), scaled by its cap * log2(e); a
    sliding-window layer masks every tile (keys past each row and keys at or before its
    position - window), as `triton_prefill` does. layer: (window, cap) of the layer."""
    BLOCK_N: gl.constexpr = s.type.shape[1]
    window, cap = layer
    score_scale = qk_scale
    if CAPPED:
        s = _tanh(s * qk_scale)
        score_scale = cap * 1.4426950408889634
    # The softmax in both arms: with it after the join, ptxas would wait for the consumer's
    # P V product before it (module docstring).
    if WINDOWED:
        n = start + gl.arange(0, BLOCK_N, layout=col_layout)
        seen = (pos[:, None] >= n[None, :]) & (n[None, :] > pos[:, None] - window)
        s = gl.where(seen, s, float("-inf"))
        p, m_new, l_new, alpha = _online_softmax(s, m_i, l_i, score_scale, WINDOWED)
    elif start >= full_end:  # a tile past the block's first row: keys past each row's position
        n = start + gl.arange(0, BLOCK_N, layout=col_layout)
        s = gl.where(pos[:, None] >= n[None, :], s, float("-inf"))
        p, m_new, l_new, alpha = _online_softmax(s, m_i, l_i, score_scale, WINDOWED)
    else:
        p, m_new, l_new, alpha = _online_softmax(s, m_i, l_i, score_scale, WINDOWED)
    return p, m_new, l_new, alpha


@gluon.jit
def _block_tiles(q_len, k_len, m_block, window, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 WINDOWED: gl.constexpr):
    """The block's first row position, the end of the tiles no row of it masks, its first tile
    (the one holding its first row's first key in a window, else 0) and the end of its tiles."""
    first_pos = k_len - q_len + m_block * BLOCK_M
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    first_tile = 0
    if WINDOWED:
        first_tile = gl.maximum(first_pos - window + 1, 0) // BLOCK_N
    return first_pos, full_end, first_tile, gl.cdiv(gl.minimum(first_pos + BLOCK_M, k_len), BLOCK_N)


@gluon.jit
def _consume(bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, layer, half):
    """One consumer warpgroup: rows half * 64 .. + 63 of the block. Tile i of the block's is the
    keys' tile first_tile + i; it sits in slot i % NUM_STAGES."""
    q_bufs, k_bufs, v_bufs, flags = bufs
    q_ready, k_ready, v_ready, k_empty, v_empty, turns = bars
    WINDOWED: gl.constexpr = flags.type.shape[0] == 2
    CAPPED: gl.constexpr = flags.type.shape[1] == 2
    TAKE_TURNS: gl.constexpr = turns.type.shape[0] == 2
    h, q_first, q_len, k_len, m_block = scalars
    BLOCK_M: gl.constexpr = _SUB_M * q_bufs.type.shape[0]
    NUM_STAGES: gl.constexpr = k_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    D: gl.constexpr = k_bufs.type.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    first_row = m_block * BLOCK_M + half * _SUB_M
    pos = k_len - q_len + first_row + gl.arange(0, _SUB_M, layout=s_rows)
    first_pos, full_end, first_tile, end_tile = _block_tiles(q_len, k_len, m_block, layer[0], BLOCK_M, BLOCK_N,
                                                             WINDOWED)
    n_tiles = end_tile - first_tile

    q_smem = q_bufs.index(half)
    mbarrier.wait(q_ready.index(half), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = gl.zeros((_SUB_M, BLOCK_N), gl.float32, layout=s_layout)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    m_i = gl.full((_SUB_M, ), float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros((_SUB_M, ), gl.float32, layout=s_rows)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, pos, first_tile * BLOCK_N, full_end, qk_scale, s_cols, layer,
                                       WINDOWED, CAPPED)
    p = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
    acc = gl.zeros((_SUB_M, D), gl.float32, layout=o_layout)
    for i in range(1, n_tiles):
        slot = i % NUM_STAGES
        prev = (i - 1) % NUM_STAGES
        mbarrier.wait(k_ready.index(slot), (i // NUM_STAGES) & 1)
        if TAKE_TURNS:  # consumer 0 issues first (a fresh barrier passes parity 1), then they alternate
            mbarrier.wait(turns.index(half), (i - half) & 1)
        s_next = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), s, use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]  # tile i - 1's factor, before its P V
        mbarrier.wait(v_ready.index(prev), ((i - 1) // NUM_STAGES) & 1)
        acc_next = warpgroup_mma(p, v_bufs.index(prev), acc, is_async=True)
        if TAKE_TURNS:
            mbarrier.arrive(turns.index(1 - half), count=1)
        s = warpgroup_mma_wait(1, deps=(s_next, ))  # S_i is done; P_{i-1} V_{i-1} may still run
        mbarrier.arrive(k_empty.index(slot), count=1)  # so K_i's slot may take K_{i + NUM_STAGES}
        p_i, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, pos, (first_tile + i) * BLOCK_N, full_end, qk_scale,
                                             s_cols, layer, WINDOWED, CAPPED)
        acc, p = warpgroup_mma_wait(0, deps=(acc_next, p))
        mbarrier.arrive(v_empty.index(prev), count=1)
        p = gl.convert_layout(p_i.to(v_bufs.dtype), p_layout)
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
def _second_consumer(descs, bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, layer, k_first, col):
    _consume(bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, layer, 1)


@gluon.jit
def _produce(descs, bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, layer, k_first, col):
    """The producer warp: the block's Q, then K and V tile by tile into the free slots."""
    q_desc, k_desc, v_desc = descs
    q_bufs, k_bufs, v_bufs, flags = bufs
    q_ready, k_ready, v_ready, k_empty, v_empty, turns = bars
    h, q_first, q_len, k_len, m_block = scalars
    CONSUMERS: gl.constexpr = q_bufs.type.shape[0]
    NUM_STAGES: gl.constexpr = k_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    D: gl.constexpr = k_bufs.type.shape[2]
    first_pos, full_end, first_tile, end_tile = _block_tiles(q_len, k_len, m_block, layer[0], _SUB_M * CONSUMERS,
                                                             BLOCK_N, flags.type.shape[0] == 2)
    for i in gl.static_range(CONSUMERS):
        mbarrier.expect(q_ready.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_first + (m_block * CONSUMERS + i) * _SUB_M, h * D],
                                        q_ready.index(i), q_bufs.index(i))
    for i in range(end_tile - first_tile):
        slot = i % NUM_STAGES
        free = ((i // NUM_STAGES) & 1) ^ 1  # a fresh barrier passes parity 1
        key = k_first + (first_tile + i) * BLOCK_N
        mbarrier.wait(k_empty.index(slot), free)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [key, col], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), free)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [key, col], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _prefill_kernel(q_desc, k_desc, v_desc, o_ptr, cu_q_ptr, cu_k_ptr, qk_scale, stride_ot, stride_oh, window, cap,
                    GROUP: gl.constexpr, CONSUMERS: gl.constexpr, NUM_STAGES: gl.constexpr,
                    TAKE_TURNS: gl.constexpr, WINDOWED: gl.constexpr, CAPPED: gl.constexpr):
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
    # The partitions' arguments arrive as runtime values, so whether the layer has a window and a
    # cap travels in this (unused) buffer's shape: 2 rows with a window, 2 columns with a cap.
    flags = gl.allocate_shared_memory(gl.int8, [2 if WINDOWED else 1, 2 if CAPPED else 1],
                                      gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)

    bufs = (q_bufs, k_bufs, v_bufs, flags)
    bars = (q_ready, k_ready, v_ready, k_empty, v_empty, turns)
    scalars = (h, q_first, q_len, k_len, m_block)
    layer = (window, cap)
    # Worker partitions share one signature; the other constants travel in the buffers' shapes.
    workers = ((q_desc, k_desc, v_desc), bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, layer, k_first,
               (h // GROUP) * D)
    first = (bufs, bars, scalars, o_ptr, stride_ot, stride_oh, qk_scale, layer, 0)
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
    scale: float, out: torch.Tensor, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """`prefill.prefill_attention` for inputs where `usable(q)`; writes and returns out."""
    t, hq, d = q.shape
    block_n = key_tile(d)
    # One consumer when every block has at most 64 rows (decode-sized tails, a full hit's one row).
    consumers = 2 if max_q > SUB_M else 1
    grid = (hq, triton.cdiv(max_q, SUB_M * consumers), cu_q.shape[0] - 1)
    _prefill_kernel[grid](
        _descriptor(q, SUB_M), _descriptor(k, block_n), _descriptor(v, block_n), out, cu_q, cu_k,
        qk_factor(scale, softcap), out.stride(0), out.stride(1), window or 0, softcap or 0.0,
        GROUP=hq // k.shape[1], CONSUMERS=consumers, NUM_STAGES=STAGES, TAKE_TURNS=PINGPONG and consumers == 2,
        WINDOWED=window is not None, CAPPED=softcap is not None,
        num_warps=4,
        maxnreg=MAX_REGISTERS if consumers == 2 else None,
    )
    return out
