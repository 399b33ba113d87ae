"""The paged KV cache: one block-major tensor per engine, and gather/scatter in named layouts.

    pages[num_blocks, 2, num_layers, block_size, kv_heads, head_dim]

      block b ──┬── K ──┬── layer 0 ── tokens 0..bs-1 ── heads ── head_dim
                │       ├── layer 1 ── ...
                │       └── layer L-1
                └── V ──┴── (same)

One block of all layers is one contiguous range, so moving a block to or from a tier is one
copy; and for its tokens the bytes are already LMCache's KV_2LTD order `[2, L, T, H*D]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import torch

from kvtool.engine.errors import KVRefused
from kvtool.engine.kv.dtypes import ELEMENT_BYTES, torch_dtype

Layout = Literal["block_major", "KV_2LTD"]

DTYPES = {name: torch_dtype(name) for name in ELEMENT_BYTES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class KVGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of one engine's KV pages; connectors record it and re-check it before moving bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def element_size(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def kv_hidden_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_hidden_size * self.element_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def describe(self) -> str:
        return (
            f"layers={self.num_layers} kv_hidden={self.kv_hidden_size} "
            f"(heads={self.num_kv_heads} x dim={self.head_dim}) block={self.block_size} "
            f"dtype={self.dtype} elem={self.element_size}B"
        )


def refuse_geometry_mismatch(recorded: KVGeometry, actual: KVGeometry, what: str) -> None:
    """Raise KVRefused naming both geometries when a connector's record disagrees with the pages."""
    fields = ("num_layers", "num_kv_heads", "head_dim", "dtype")
    diffs = [f for f in fields if getattr(recorded, f) != getattr(actual, f)]
    if diffs:
        raise KVRefused(
            f"{what}: KV geometry mismatch on {', '.join(diffs)}: "
            f"recorded [{recorded.describe()}] vs engine pages [{actual.describe()}]"
        )


class KVPages:
    """Owns the KV tensor. Writers: the attention layers (new tokens) and connectors (scatter)."""

    def __init__(self, geometry: KVGeometry, num_blocks: int, device: torch.device) -> None:
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.device = device
        g = geometry
        # [num_blocks, 2, L, bs, H, D]. Zeroed on CUDA, where kernels may read a block's unused
        # slots under a mask (0 x NaN would be NaN); on CPU the reference path reads written
        # tokens only, and an untouched allocation costs no memory until the pages are used.
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.tensor = alloc(
            (num_blocks, 2, g.num_layers, g.block_size, g.num_kv_heads, g.head_dim),
            dtype=DTYPES[g.dtype],
            device=device,
        )

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor, offsets: torch.Tensor
    ) -> None:
        """Store new tokens' K and V ([T, H, D] each) at (block_ids[t], offsets[t]) of one layer."""
        self.tensor[block_ids, 0, layer, offsets] = k.to(self.tensor.dtype)
        self.tensor[block_ids, 1, layer, offsets] = v.to(self.tensor.dtype)

    def read_layer(self, layer: int, block_ids: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for a sequence's first num_tokens tokens. Returns ([T, H, D], [T, H, D])."""
        g = self.geometry
        kv = self.tensor[block_ids, :, layer]  # [nb, 2, bs, H, D]
        kv = kv.transpose(0, 1).reshape(2, -1, g.num_kv_heads, g.head_dim)[:, :num_tokens]
        return kv[0], kv[1]

    def gather(self, block_ids: Sequence[int], layout: Layout = "block_major", num_tokens: int | None = None) -> torch.Tensor:
        """Copy blocks out into a new contiguous tensor.

        block_major: [nb, 2, L, bs, H, D]; KV_2LTD: [2, L, T, H*D] over the first num_tokens
        tokens of the blocks (default: all of them).
        """
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        blocks = self.tensor.index_select(0, idx)
        if layout == "block_major":
            return blocks
        g = self.geometry
        total = len(block_ids) * g.block_size
        n = total if num_tokens is None else num_tokens
        # [nb, 2, L, bs, H, D] -> [2, L, nb, bs, H, D] -> [2, L, nb*bs, H*D]
        out = blocks.permute(1, 2, 0, 3, 4, 5).reshape(2, g.num_layers, total, g.kv_hidden_size)
        return out[:, :, :n].contiguous()

    def scatter(self, block_ids: Sequence[int], data: torch.Tensor, layout: Layout = "block_major", num_tokens: int | None = None) -> None:
        """Write a gathered tensor (same layout and shape as `gather` returns) back into blocks."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        data = data.to(device=self.device, dtype=self.tensor.dtype)
        if layout == "block_major":
            self.tensor.index_copy_(0, idx, data)
            return
        g = self.geometry
        total = len(block_ids) * g.block_size
        n = total if num_tokens is None else num_tokens
        if n == total:
            blocks = data.reshape(2, g.num_layers, len(block_ids), g.block_size, g.num_kv_heads, g.head_dim)
            self.tensor.index_copy_(0, idx, blocks.permute(2, 0, 1, 3, 4, 5))
            return
        # Partial last block: write token by token range so the tail of the block is untouched.
        for i, b in enumerate(block_ids):
            lo, hi = i * g.block_size, min((i + 1) * g.block_size, n)
            if hi <= lo:
                break
            part = data[:, :, lo:hi].reshape(2, g.num_layers, hi - lo, g.num_kv_heads, g.head_dim)
            self.tensor[b, :, :, : hi - lo] = part
