"""Prefill attention on CUDA whose rows do not depend on where the computation starts.

A KV hit leaves the last rows of a prompt to compute; the same rows inside a one-shot prefill
must come out with the same bits, or a greedy token can flip between a run with a connector and
one without. Library kernels do not promise that (cuDNN's rows change with the first row
computed), so every prefill row goes through this Triton kernel. Each program owns BLOCK_M
query rows of one head of one sequence and walks the keys from position 0 in tiles of BLOCK_N
on a grid fixed at position 0, with an online softmax in float32. A row therefore sees the same
tiles in the same order whichever rows share its program, and the tiles past its own position
(reached because a later row of its block needs them) are masked to exact zeros. BLOCK_N is the
one constant that fixes the rounding (`key_tile`, by head size); BLOCK_M and the number of rows
per call do not. On an H200 it runs causal Qwen3-8B heads somewhat slower than cuDNN's SDPA
(`scripts/gpu-bench.py kernels` measures both).

Sequences are packed varlen style: q [T, Hq, D] with cu_q, keys [sum ctx, Hkv, D] with cu_k;
a sequence's query rows are the last q_len positions of its ctx_len keys (bottom-right causal).

On Hopper and later the tiles come in through TMA tensor descriptors (the copy engine of each SM
moves them into shared memory while the warps compute); elsewhere through pointer loads. Both
give the same bits. A descriptor's tile may run past a sequence's keys into the next one's (or
into zeros past the tensor): those keys are past every row's position, so they are masked to
exact zeros as any key past a row is. With descriptors the one row of a full hit over 32k keys
takes about half the time it takes without on an H200 (the whole causal prefill about the same).

On Hopper itself, for 16-bit heads of 64, 128 or 256, `prefill.prefill_attention` runs
`hopper_prefill` instead: the same row contract in a warp-specialized Gluon kernel.

A sliding-window layer (WINDOW > 0) masks the keys at or before each row's position - WINDOW in
every tile, from the tile holding the block's first row's first key on. A tile a row sees none
of leaves its state as it was (zeros and a maximum of -inf before its first key), so a row's
bits still do not depend on where its block starts.

A soft-capped layer (SOFTCAP c > 0, Gemma 2) takes qk_scale = scale / c: each tile's products
become tanh(scale * q.k / c) before the masks, and c * log2(e) takes qk_scale's place in the
online softmax (the same explicit FMA), so the capped score tanh(s / c) * c enters it in base 2.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kvtool.engine.kernels.attention.triton_ops import qk_factor, tanh


def key_tile(head_dim: int) -> int:
    """BLOCK_N for a head size: fixed per model, since it fixes each row's accumulation order."""
    return 128 if head_dim <= 128 else 64


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, pos, k_src, v_src, k_first, k_len, stride_kt, stride_vt, d, d_ok, col, lo, hi,
                  MASKED: tl.constexpr, qk_scale, BLOCK_N: tl.constexpr, TMA: tl.constexpr, WINDOW: tl.constexpr,
                  SOFTCAP: tl.constexpr):
    """Fold the key tiles starting at lo, lo + BLOCK_N, .. below hi into the online softmax.
    k_src/v_src: tensor descriptors of [keys, Hkv * D] (TMA), or the head's base pointers."""
    score_scale = qk_scale
    if SOFTCAP > 0:  # the products become tanh(s / SOFTCAP); the softmax scales those to base 2
        score_scale = SOFTCAP * 1.4426950408889634
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        if TMA:
            k = tl.trans(k_src.load([k_first + start, col]))
        else:
            keys = (k_first + n).to(tl.int64)
            k = tl.load(k_src + keys[None, :] * stride_kt + d[:, None], mask=(n[None, :] < k_len) & d_ok[:, None],
                        other=0.0)
        s = tl.dot(q, k)
        if SOFTCAP > 0:
            s = tanh(s * qk_scale)
        if MASKED:
            s = tl.where(pos[:, None] >= n[None, :], s, float("-inf"))
        if WINDOW > 0:
            s = tl.where(n[None, :] > pos[:, None] - WINDOW, s, float("-inf"))
        # The scale enters through one explicit FMA: left to the compiler, the product and the
        # subtraction would be contracted in the unmasked loop only, and a tile would round
        # differently depending on which loop reached it.
        m_new = tl.maximum(m_i, tl.max(s, 1) * score_scale)
        m_use = m_new
        if WINDOW > 0:  # a row that has seen no key yet: its state stays exact zeros, its maximum -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(tl.fma(s, score_scale, -m_use[:, None]))
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            v = v_src.load([k_first + start, col])
        else:
            v = tl.load(v_src + keys[:, None] * stride_vt + d[None, :], mask=(n[:, None] < k_len) & d_ok[None, :],
                        other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_src, k_src, v_src, o_ptr, cu_q_ptr, cu_k_ptr, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    h = tl.program_id(0)
    seq = tl.program_id(2)
    q_first = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_first
    k_first = tl.load(cu_k_ptr + seq)
    k_len = tl.load(cu_k_ptr + seq + 1) - k_first
    # The longest blocks (the last rows of the longest sequence) start first.
    m_block = tl.cdiv(q_len, BLOCK_M) - 1 - tl.program_id(1)
    if m_block >= 0:
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        pos = k_len - q_len + rows  # absolute position of each query row
        d = tl.arange(0, DP)
        d_ok = d < D
        q_rows = (q_first + rows).to(tl.int64)
        col = (h // GROUP) * D
        if TMA:
            q = q_src.load([q_first + m_block * BLOCK_M, h * D])
            k_base = k_src
            v_base = v_src
        else:
            q = tl.load(q_src + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            k_base = k_src + (h // GROUP) * stride_kh
            v_base = v_src + (h // GROUP) * stride_vh
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, DP), dtype=tl.float32)
        first_pos = k_len - q_len + m_block * BLOCK_M
        # Tiles wholly at or before the block's first row need no mask; the rest run to the
        # block's last key. Key 0 is in every row's first tile, so no row starts at -inf.
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
        last = tl.minimum(first_pos + BLOCK_M, k_len)
        if WINDOW > 0:  # every tile masked, from the one with the block's first row's first key
            lo = tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
            acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, pos, k_base, v_base, k_first, k_len, stride_kt,
                                          stride_vt, d, d_ok, col, lo, last, True, qk_scale, BLOCK_N, TMA, WINDOW,
                                          SOFTCAP)
        else:
            acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, pos, k_base, v_base, k_first, k_len, stride_kt,
                                          stride_vt, d, d_ok, col, 0, full_end, False, qk_scale, BLOCK_N, TMA, 0,
                                          SOFTCAP)
            acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, pos, k_base, v_base, k_first, k_len, stride_kt,
                                          stride_vt, d, d_ok, col, full_end, last, True, qk_scale, BLOCK_N, TMA, 0,
                                          SOFTCAP)
        out = acc / l_i[:, None]
        tl.store(o_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def rows_view(x: torch.Tensor) -> torch.Tensor | None:
    """x [T, H, D] (heads adjacent) as [T, H * D] sharing its memory, or None when a TMA descriptor
    cannot describe it (heads not adjacent, or an address or row stride off 16 bytes)."""
    t, h, d = x.shape
    size = x.element_size()
    if x.stride(2) != 1 or x.stride(1) != d or (x.stride(0) * size) % 16 or x.data_ptr() % 16:
        return None
    return x.as_strided((t, h * d), (x.stride(0), 1))


_tma_devices: dict[int, bool] = {}


def _has_tma(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _tma_devices:
        _tma_devices[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _tma_devices[index]


def launch_config(head_dim: int, max_q: int) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, num_stages) for a call whose longest sequence has max_q query rows.
    The row block and the tiles in flight do not move a row's bits (BLOCK_N, `key_tile`, does, and
    so do the rows per warp, which every launch of a head size keeps), so the choice is speed
    alone: blocks of 128 rows once a sequence fills them, eight warps for those and for heads past
    128 (Gemma's 256, whose [64, D] float32 output four warps cannot hold in registers: sm_90 code
    spills), and three K / V tiles in flight (`gpu-bench.py prefill-tiles` on an H100: Gemma 3 4B's
    global layer at 32k took 13.9 ms with three, 16.2 with two)."""
    block_n = key_tile(head_dim)
    block_m = 128 if max_q > 64 and block_n == 128 else 64
    warps = 8 if block_m == 128 or head_dim > 128 else 4
    return block_m, warps, 3


# Shared memory a launch may fill with its tiles: the Q block and each K / V tile in flight (a
# Hopper SM has 227 KiB; the 128-row blocks of 128-wide heads with 3 tiles in flight fill 224).
SHARED_TILE_BYTES = 224 * 1024


def launch_candidates(head_dim: int) -> list[tuple[int, int, int]]:
    """Every (BLOCK_M, num_warps, num_stages) worth timing for a 16-bit head size: row blocks of 64
    or 128 with the default launch's rows per warp, 1 to 3 K / V tiles in flight, within
    SHARED_TILE_BYTES. The rows per warp stay: they fix how the warps share a block's columns
    (16: each warpgroup holds whole rows; 8, the 256-wide heads': two warpgroups hold half a row
    each), and with it the order in which a row's probabilities are summed."""
    block_m, warps, _ = launch_config(head_dim, 65)
    block_n = key_tile(head_dim)
    return [(bm, bm * warps // block_m, stages) for bm in (64, 128) for stages in (1, 2, 3)
            if 2 * head_dim * (bm + 2 * stages * block_n) <= SHARED_TILE_BYTES]


def triton_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    scale: float, out: torch.Tensor, window: int | None = None, softcap: float | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Causal attention of packed sequences through the Triton kernel above, on any CUDA device
    (each row over its last `window` keys when given; its scores soft-capped at `softcap` when given):
    q [T > 0, Hq, D], k/v [sum ctx, Hkv, D] (last dim contiguous), cu_q/cu_k [S + 1] int32.
    `config` (BLOCK_M, num_warps, num_stages) replaces `launch_config`'s (the same bits).
    Writes and returns out [T, Hq, D]."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    block_n = key_tile(d)
    block_m, warps, stages = config or launch_config(d, max_q)
    grid = (hq, triton.cdiv(max_q, block_m), cu_q.shape[0] - 1)
    srcs = (q, k, v)
    # A descriptor's tile is a power of two wide: other head sizes load through pointers, padded.
    dp = triton.next_power_of_2(d)
    views = [rows_view(x) for x in srcs] if _has_tma(q.device) and dp == d else [None]
    tma = all(x is not None for x in views)
    if tma:
        srcs = tuple(TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, d])
                     for x, rows in zip(views, (block_m, block_n, block_n)))
    _prefill_kernel[grid](
        *srcs, out, cu_q, cu_k, qk_factor(scale, softcap),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUP=hq // hkv, D=d, DP=dp, BLOCK_M=block_m, BLOCK_N=block_n, TMA=tma, WINDOW=window or 0,
        SOFTCAP=softcap or 0.0, num_warps=warps, num_stages=stages,
    )
    return out
