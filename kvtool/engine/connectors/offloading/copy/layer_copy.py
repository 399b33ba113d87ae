"""A Triton kernel that copies one layer's K and V of many blocks between the pinned pool and pages.

Pinned host memory is mapped into the device's address space, so the kernel reads or writes the
pool over PCIe directly: one launch moves every piece of a layer (2 per block, bs*H*D elements
each, strided by L in both layouts), where the copy engine would need one transfer per piece.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # elements per program


@triton.jit
def _copy_layer_kernel(src_ptr, dst_ptr, pairs_ptr, layer, num_layers, piece, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    kv = tl.program_id(1)
    c = tl.program_id(2)
    src_blk = tl.load(pairs_ptr + 2 * i)
    dst_blk = tl.load(pairs_ptr + 2 * i + 1)
    block_elems = 2 * num_layers * piece.to(tl.int64)
    inner = (kv * num_layers + layer).to(tl.int64) * piece
    o = c * CHUNK + tl.arange(0, CHUNK)
    mask = o < piece
    x = tl.load(src_ptr + src_blk * block_elems + inner + o, mask=mask)
    tl.store(dst_ptr + dst_blk * block_elems + inner + o, x, mask=mask)


def copy_layer(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, layer: int) -> None:
    """Copy layer `layer` of src blocks into dst blocks; pairs [N, 2] int64 (src block, dst block) on the device.

    src and dst are [*, 2, L, bs, H, D], contiguous: the pinned pool and the device pages, either way round.
    """
    n = pairs.shape[0]
    if n == 0:
        return
    num_layers = src.shape[2]
    piece = src[0, 0, 0].numel()
    _copy_layer_kernel[(n, 2, triton.cdiv(piece, CHUNK))](
        src, dst, pairs, layer, num_layers, piece, CHUNK=CHUNK, num_warps=4
    )


def probe_pinned_access(pool: torch.Tensor, pages: torch.Tensor) -> bool:
    """Whether the kernel can read and write the pool: pinned, contiguous, and accepted by the
    launcher. Reads one pool block; writes only a pinned scratch block, never the pool."""
    if not (pool.is_pinned() and pool.is_contiguous() and pages.is_contiguous() and pages.is_cuda):
        return False
    try:
        scratch = torch.empty((1, *pages.shape[1:]), dtype=pages.dtype, device=pages.device)
        pairs = torch.zeros((1, 2), dtype=torch.int64, device=pages.device)
        copy_layer(pool[:1], scratch, pairs, 0)
        host = torch.zeros((1, *pages.shape[1:]), dtype=pages.dtype).pin_memory()
        copy_layer(scratch, host, pairs, 0)
        torch.cuda.synchronize(pages.device)
        expected = pool[0, :, 0].contiguous().view(torch.uint8)
        read_ok = torch.equal(scratch[0, :, 0].cpu().contiguous().view(torch.uint8), expected)
        return bool(read_ok and torch.equal(host[0, :, 0].contiguous().view(torch.uint8), expected))
    except (ValueError, RuntimeError):
        return False
