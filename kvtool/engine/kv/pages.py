"""The paged KV cache: one block-major tensor per engine, and gather/scatter in named layouts.

    pages[num_blocks, 2, num_layers, block_size, kv_heads, head_dim]

      block b ──┬── K ──┬── layer 0 ── tokens 0..bs-1 ── heads ── head_dim
                │       ├── layer 1 ── ...
                │       └── layer L-1
                └── V ──┴── (same)

One block of all layers is one contiguous range, so moving a block to or from a tier is one
copy; and for its tokens the bytes are already LMCache's KV_2LTD order `[2, L, T, H*D]`.

A hybrid model's cache (`kv.groups`: KV cache groups, each with its own block table) has
`num_slots` layers per block instead of all of them: block b then holds the layers of the one
group it belongs to, layer l in slot `layout.layer_slot[l]`. Every method taking a layer maps it
to its slot; the layout of one group has slot l = layer l, the tensor above.

An fp8 cache (`--kv-cache-dtype fp8`) holds each value as fp8(x / scale), saturated at the
dtype's largest finite value and rounded to nearest even, with one float32 scale per layer for K
and one for V (vLLM's per-tensor `k_scale`/`v_scale`); readers compute fp8 * scale in float32
and round to the model's dtype, as vLLM's Triton attention does. The tiers move the fp8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import torch

from kvtool.engine.errors import KVRefused
from kvtool.engine.kv.dtypes import FP8_MAX, KV_ELEMENT_BYTES, torch_dtype
from kvtool.engine.kv.groups import KVCacheLayout, single_group

Layout = Literal["block_major", "KV_2LTD"]
# vLLM's --calculate-kv-scales divisors (its K_SCALE_CONSTANT and V_SCALE_CONSTANT).
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0

DTYPES = {name: torch_dtype(name) for name in KV_ELEMENT_BYTES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class KVGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of one engine's KV pages; connectors record it and re-check it before moving bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16" | "float8_e4m3fn" | "float8_e5m2"

    @property
    def element_size(self) -> int:
        return KV_ELEMENT_BYTES[self.dtype]

    @property
    def quantized(self) -> bool:
        """An fp8 cache: values stored divided by their layer's scale."""
        return self.dtype in FP8_MAX

    @property
    def storage_dtype(self) -> str:
        """The dtype vLLM allocates its pages in, which LMCache keys and moves: uint8 for an fp8 cache."""
        return "uint8" if self.quantized else self.dtype

    @property
    def kv_hidden_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_hidden_size * self.element_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def block_bytes(self, layers: int) -> int:
        """Bytes of one block holding `layers` layers (a KV cache group's slots, or all of them)."""
        return self.bytes_per_block // self.num_layers * layers

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

    def __init__(self, geometry: KVGeometry, num_blocks: int, device: torch.device,
                 k_scales: Sequence[float] | None = None, v_scales: Sequence[float] | None = None,
                 layout: KVCacheLayout | None = None) -> None:
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.device = device
        self.layout = layout if layout is not None else single_group(geometry.num_layers)
        if self.layout.num_layers != geometry.num_layers:
            raise ValueError(f"KV cache layout of {self.layout.num_layers} layers for pages of {geometry.num_layers}")
        # layer -> its slot in a block (the layer itself with one group)
        self.slot_of = self.layout.layer_slot
        g = geometry
        # [num_blocks, 2, slots, bs, H, D]. Zeroed on CUDA, where kernels may read a block's
        # unused slots under a mask (0 x NaN would be NaN); on CPU the reference path reads
        # written tokens only, and an untouched allocation costs no memory until the pages are
        # used. A hybrid layout's block 0 (the pool's null block, which no request writes) is
        # zeroed everywhere: tables point their freed blocks at it, and the CPU kernels read it
        # under a mask.
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.tensor = alloc(
            (num_blocks, 2, self.layout.num_slots, g.block_size, g.num_kv_heads, g.head_dim),
            dtype=DTYPES[g.dtype],
            device=device,
        )
        if self.layout.hybrid and num_blocks:
            self.tensor[0].zero_()
        # [L] float32 each, on the pages' device (kernels read them there): 1.0 unless given.
        ones = [1.0] * g.num_layers
        self.k_scale = torch.tensor(ones if k_scales is None else list(k_scales), dtype=torch.float32, device=device)
        self.v_scale = torch.tensor(ones if v_scales is None else list(v_scales), dtype=torch.float32, device=device)
        if self.k_scale.shape != (g.num_layers,) or self.v_scale.shape != (g.num_layers,):
            raise ValueError(f"KV scales must be one per layer ({g.num_layers})")
        # --calculate-kv-scales: the layers whose scales still wait for their first K/V.
        self._scales_pending: set[int] = set()

    def calculate_scales_from_next_kv(self) -> None:
        """vLLM's --calculate-kv-scales for an fp8 cache: each layer's scales become those of the
        next K/V it stores (the runner arms this once its warm-up steps are done)."""
        if self.quantized:
            self._scales_pending = set(range(self.geometry.num_layers))

    @property
    def scales_pending(self) -> bool:
        """Some layer's scales are still to be calculated from its next K/V."""
        return bool(self._scales_pending)

    def calculate_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The layer's scales from k, v [T, H, D], the first real K/V it stores after
        `calculate_scales_from_next_kv` (max |k| / 200, max |v| / 100: vLLM's K_SCALE_CONSTANT
        and V_SCALE_CONSTANT; all-zero K or V keeps a scale above zero), updated in place (graphs
        read them by address), once. A no-op for a layer that has its scales, or for no tokens."""
        if layer not in self._scales_pending or k.shape[0] == 0:
            return
        self._scales_pending.discard(layer)
        tiny = torch.finfo(torch.float32).tiny
        self.k_scale[layer].copy_((k.abs().amax().float() / K_SCALE_CONSTANT).clamp_min(tiny))
        self.v_scale[layer].copy_((v.abs().amax().float() / V_SCALE_CONSTANT).clamp_min(tiny))

    @property
    def quantized(self) -> bool:
        return self.geometry.quantized

    def quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x in the pages' dtype: fp8(x / scale) saturated, for an fp8 cache; else x converted."""
        if not self.quantized:
            return x.to(self.tensor.dtype)
        limit = FP8_MAX[self.geometry.dtype]
        return (x.float() / scale).clamp_(-limit, limit).to(self.tensor.dtype)

    def dequantize(self, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored values x as `dtype`: fp8 * scale in float32, rounded once; else x converted."""
        if not self.quantized:
            return x.to(dtype)
        return (x.float() * scale).to(dtype)

    def select(self, layer: int, kv: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Blocks `block_ids` of one layer's K (kv=0) or V (kv=1) into out [n, bs, H, D], in out's dtype."""
        pages = self.tensor[:, kv, self.slot_of[layer]]
        if not self.quantized and out.dtype == pages.dtype:
            torch.index_select(pages, 0, block_ids, out=out)
            return
        scale = (self.k_scale if kv == 0 else self.v_scale)[layer]
        out.copy_(self.dequantize(self._bytes(pages).index_select(0, block_ids).view(pages.dtype), scale, out.dtype))

    def _bytes(self, t: torch.Tensor) -> torch.Tensor:
        """t (the pages or a view of them) as its bytes for an fp8 cache, which torch indexes on
        every device (it has no fp8 index kernels on some); t itself otherwise."""
        return t.view(torch.uint8) if self.quantized else t

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: every layer's K/V of its tokens, or one group's layers (its slots)."""
        return self.geometry.block_bytes(self.layout.num_slots)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor, offsets: torch.Tensor
    ) -> None:
        """Store new tokens' K and V ([T, H, D] each) at (block_ids[t], offsets[t]) of one layer
        (quantised with the layer's scales in an fp8 cache)."""
        self.calculate_scales(layer, k, v)
        pages, slot = self._bytes(self.tensor), self.slot_of[layer]
        pages[block_ids, 0, slot, offsets] = self._bytes(self.quantize(k, self.k_scale[layer]))
        pages[block_ids, 1, slot, offsets] = self._bytes(self.quantize(v, self.v_scale[layer]))

    def read_layer(self, layer: int, block_ids: torch.Tensor, num_tokens: int,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for a sequence's first num_tokens tokens, as `dtype` (default the
        pages'; an fp8 cache's values come back dequantised). Returns ([T, H, D], [T, H, D])."""
        g = self.geometry
        kv = self._bytes(self.tensor)[block_ids, :, self.slot_of[layer]].view(self.tensor.dtype)  # [nb, 2, bs, H, D]
        kv = kv.transpose(0, 1).reshape(2, -1, g.num_kv_heads, g.head_dim)[:, :num_tokens]
        if dtype is None:
            return kv[0], kv[1]
        return (self.dequantize(kv[0], self.k_scale[layer], dtype),
                self.dequantize(kv[1], self.v_scale[layer], dtype))

    def gather(self, block_ids: Sequence[int], layout: Layout = "block_major", num_tokens: int | None = None) -> torch.Tensor:
        """Copy blocks out into a new contiguous tensor.

        block_major: [nb, 2, slots, bs, H, D]; KV_2LTD: [2, slots, T, H*D] over the first
        num_tokens tokens of the blocks (default: all of them), which are one group's (with one
        group, its slots are every layer).
        """
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        blocks = self._bytes(self.tensor).index_select(0, idx).view(self.tensor.dtype)
        if layout == "block_major":
            return blocks
        g = self.geometry
        total = len(block_ids) * g.block_size
        n = total if num_tokens is None else num_tokens
        # [nb, 2, slots, bs, H, D] -> [2, slots, nb, bs, H, D] -> [2, slots, nb*bs, H*D]
        out = blocks.permute(1, 2, 0, 3, 4, 5).reshape(2, self.layout.num_slots, total, g.kv_hidden_size)
        return out[:, :, :n].contiguous()

    def scatter(self, block_ids: Sequence[int], data: torch.Tensor, layout: Layout = "block_major", num_tokens: int | None = None) -> None:
        """Write a gathered tensor (same layout and shape as `gather` returns) back into blocks.
        An fp8 cache also takes its bytes as uint8 (what vLLM allocates and LMCache moves)."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        if self.quantized and data.dtype == torch.uint8:
            data = data.view(self.tensor.dtype)
        data = data.to(device=self.device, dtype=self.tensor.dtype)
        pages, data = self._bytes(self.tensor), self._bytes(data)
        if layout == "block_major":
            pages.index_copy_(0, idx, data)
            return
        g = self.geometry
        total = len(block_ids) * g.block_size
        n = total if num_tokens is None else num_tokens
        if n == total:
            blocks = data.reshape(2, self.layout.num_slots, len(block_ids), g.block_size, g.num_kv_heads, g.head_dim)
            pages.index_copy_(0, idx, blocks.permute(2, 0, 1, 3, 4, 5))
            return
        # Partial last block: write token by token range so the tail of the block is untouched.
        for i, b in enumerate(block_ids):
            lo, hi = i * g.block_size, min((i + 1) * g.block_size, n)
            if hi <= lo:
                break
            part = data[:, :, lo:hi].reshape(2, self.layout.num_slots, hi - lo, g.num_kv_heads, g.head_dim)
            pages[b, :, :, : hi - lo] = part
