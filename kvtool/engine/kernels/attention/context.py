"""Per-step attention metadata, set by the runner for one forward and read by the attention layers
(and, for `row_invariant`, by the CUDA fused forwards' projections).

The runner wraps each forward in `with attention_context(meta):`; models never receive it as an
argument, and nothing but the runner writes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvtool.engine.kv.pages import KVPages


class LayerHooks(Protocol):
    """Called around each layer's attention (a connector's worker half, for layerwise transfers)."""

    def before_layer(self, layer: int) -> None: ...

    def after_layer(self, layer: int) -> None: ...


@dataclass(slots=True)
class SeqSpan:
    """One sequence of the packed batch.

    Token ranges (absolute positions) of the sequence during this step:

        |<------------- ctx_len ------------->|
        |<-- ctx_len - q_len -->|<-- q_len -->|
         already in the pages     computed now (rows q_start..q_start+q_len of q)
    """

    q_start: int  # first row of this sequence in the packed [T, ...] tensors
    q_len: int  # new tokens computed this step
    ctx_len: int  # tokens attended to, new ones included
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] long, on the engine device


@dataclass(slots=True)
class PrefillBatch:
    """The sequences with q_len > 1 of a step, packed after the decode rows (CUDA backend).

    Rows q_start.. of q belong to them, in order; cu_q / cu_k are their cumulative query and key
    lengths (relative to q_start), as varlen attention takes them.
    """

    q_start: int
    cu_q: torch.Tensor  # [P + 1] int32
    cu_k: torch.Tensor  # [P + 1] int32
    max_q: int
    max_k: int
    # Flat page slots of every key of every prefill sequence, in order ([sum ctx_len] int32);
    # None when no sequence has a prefix (then the new K/V are the keys).
    key_slots: torch.Tensor | None


@dataclass(slots=True)
class DeviceBatch:
    """Index tensors of one step for the CUDA backend, built once per step by the runner.

    Decode sequences (q_len == 1) come first, one row each; a captured graph pads them with
    rows whose slot is -1 and whose context length is 0.
    """

    slot_mapping: torch.Tensor  # [T] int: flat page slot (block * block_size + offset) of each new token
    num_decode: int
    block_table: torch.Tensor  # [num_decode, W] int32 (a strided view is fine)
    context_lens: torch.Tensor  # [num_decode] int32
    num_splits: int  # split-KV partitions per decode sequence
    prefill: PrefillBatch | None = None
    # [num_decode] int32: the decode rows, longest context first (the kernel's launch order).
    decode_order: torch.Tensor | None = None
    # Batch-invariant decode (`triton_tiles`): [num_decode] int32 first tile slot of each row,
    # and the tile slots to allocate; None: the split-KV kernel of `triton_ops`.
    tile_base: torch.Tensor | None = None
    num_tiles: int = 0
    # The same step with its sampled rows alone as queries (every decode row, then the last row
    # of each prefill sequence that samples), for the last layer: only those rows of it are
    # needed past storing every new token's K/V. Its slot_mapping is this batch's (all T new
    # tokens). None where the step has no such batch (`pack_step` says when).
    sampled: DeviceBatch | None = None


# Tokens per tile of the batch-invariant decode kernel (`triton_tiles`).
TILE = 256


def tile_bases(context_lens: np.ndarray) -> tuple[np.ndarray, int]:
    """(first tile slot of each sequence [B] int32, tiles of the batch) for `context_lens` [B]."""
    n = -(-np.asarray(context_lens, dtype=np.int64) // TILE)
    return (np.cumsum(n) - n).astype(np.int32), int(n.sum())


def tile_capacity(batch: int, max_context: int, cache_tokens: int) -> int:
    """Tile slots that hold any batch of `batch` sequences of distinct blocks: each holds at most
    ceil(max_context / TILE), and all of them together at most one per TILE cache tokens plus one
    partial tile each. (Sequences sharing prefix blocks can need more; callers check.)"""
    return min(batch * -(-max_context // TILE), cache_tokens // TILE + batch)


def longest_first(context_lens: np.ndarray) -> np.ndarray:
    """The rows of `context_lens` by decreasing length (ties in row order), as int32."""
    return np.argsort(-np.asarray(context_lens, dtype=np.int64), kind="stable").astype(np.int32)


@dataclass(slots=True)
class AttentionMetadata:
    kv_pages: KVPages
    seqs: list[SeqSpan]
    slot_block_ids: torch.Tensor | None  # [T] long: page block of each new token (reference backend)
    slot_offsets: torch.Tensor | None  # [T] long: offset inside that block (reference backend)
    hooks: LayerHooks | None = None
    extra: dict = field(default_factory=dict)
    # Set by the runner when the CUDA backend runs the step; the reference backend reads `seqs`.
    device_batch: DeviceBatch | None = None
    # Whether the step's projections run through the row-invariant GEMMs (`row_invariant_gemm`):
    # set by the runner (prefill rows; every step of a batch-invariant engine), read by the CUDA
    # fused forwards. The reference and CPU products ignore it (their rows are invariant anyway).
    row_invariant: bool = False
    # A multi-group KV cache (`kv.groups`): each group's metadata (its seqs' block tables and
    # the step's slots in its blocks) and the group of each layer; None with one group.
    group_metas: list[AttentionMetadata] | None = None
    layer_group: tuple[int, ...] | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata `layer` attends with: its KV cache group's."""
        if self.group_metas is None:
            return self
        return self.group_metas[self.layer_group[layer]]


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def attention_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Bind `meta` for one forward; refuses to nest and always clears."""
    global _current
    if _current is not None:
        raise RuntimeError("attention_context does not nest")
    _current = meta
    try:
        yield meta
    finally:
        _current = None


def current_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention called outside attention_context")
    return _current
