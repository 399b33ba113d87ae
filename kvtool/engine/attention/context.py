"""Per-step attention metadata, set by the runner for one forward and read by the attention layers.

The runner wraps each forward in `with attention_context(meta):`; models never receive it as an
argument, and nothing but the runner writes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvtool.engine.kv_pages import KVPages


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
class AttentionMetadata:
    kv_pages: KVPages
    seqs: list[SeqSpan]
    slot_block_ids: torch.Tensor  # [T] long: page block of each new token
    slot_offsets: torch.Tensor  # [T] long: offset inside that block
    hooks: LayerHooks | None = None
    extra: dict = field(default_factory=dict)


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
