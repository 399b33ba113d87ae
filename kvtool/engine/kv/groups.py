"""KV cache groups: which layers share a block table, as vLLM's hybrid KV cache manager forms them.

A model whose layers all attend alike (full attention, or one sliding window everywhere) has one
group: every layer reads one block table, and block b of the pages holds every layer's K/V of
that block's tokens. A hybrid model (Gemma 2: local and global layers alternating; Gemma 3: five
local to one global) has groups of `num_slots` layers each, one or more per kind of layer:

    Gemma 3, 34 layers (29 local with window W, 5 global):
      group 0..5  sliding window W  layers 0,6,12,18,24 / 1,7,13,19,25 / ... (local ones only)
      group 6     full attention    layers 5,11,17,23,29

    pages[num_blocks, 2, num_slots, bs, H, D]: block b belongs to one group at a time;
    slot s of it holds layer groups[g].layers[s] of that group

Every group has its own block table over the one shared block pool, so a block costs the same
whatever group holds it. A sliding-window group needs only the blocks of a request's last W
tokens (the scheduler frees the others, `core.kv_blocks`), so its memory grows with the window,
not with the context.

The grouping is vLLM 0.33's `_get_kv_cache_groups_uniform_page_size`: layers bucketed by spec
in order of first appearance, the group size the smallest bucket's layer count (the largest when
it is under 1.5x the smallest), bucket i split as layers[j::n] into n groups, a short last group
padded with unused slots. `--disable-hybrid-kv-cache-manager` gives vLLM's unified layout: one
full-attention group of every layer when any layer attends globally (the windows then apply as
masks over a cache that keeps every token).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"  # vLLM's KVCacheSpecKind values


class KVCacheGroup(msgspec.Struct, frozen=True, kw_only=True):
    """One group's layers (in slot order) and the window they attend within (None: full attention)."""

    layers: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return FULL_ATTENTION if self.sliding_window is None else SLIDING_WINDOW

    def describe(self) -> str:
        what = "full" if self.sliding_window is None else f"window {self.sliding_window}"
        return f"{what} x{len(self.layers)}"


class KVCacheLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The groups of one engine's KV cache; every layer is in exactly one group."""

    num_layers: int
    groups: tuple[KVCacheGroup, ...]

    def __post_init__(self) -> None:
        seen = sorted(l for g in self.groups for l in g.layers)
        if seen != list(range(self.num_layers)):
            raise ValueError(f"KV cache groups must cover layers 0..{self.num_layers - 1} once each")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_slots(self) -> int:
        """Layers per block: the pages' layer dimension."""
        return max(len(g.layers) for g in self.groups)

    @property
    def hybrid(self) -> bool:
        """Whether any group frees blocks (then the pool keeps block 0 as vLLM's null block)."""
        return any(g.sliding_window is not None for g in self.groups)

    @property
    def layer_group(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for gi, g in enumerate(self.groups):
            for l in g.layers:
                out[l] = gi
        return tuple(out)

    @property
    def layer_slot(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for g in self.groups:
            for s, l in enumerate(g.layers):
                out[l] = s
        return tuple(out)

    def describe(self) -> str:
        """'1 group: full x24' or '7 groups of 5 slots: window 1024 x5 (6), full x5'."""
        if self.num_groups == 1:
            return f"1 group: {self.groups[0].describe()}"
        parts: list[str] = []
        counts: dict[str, int] = {}
        for g in self.groups:
            d = g.describe()
            if d not in counts:
                parts.append(d)
            counts[d] = counts.get(d, 0) + 1
        body = ", ".join(p if counts[p] == 1 else f"{p} ({counts[p]})" for p in parts)
        return f"{self.num_groups} groups of {self.num_slots} slots: {body}"


def single_group(num_layers: int, sliding_window: int | None = None) -> KVCacheLayout:
    """Every layer in one group (the layout of a model whose layers attend alike)."""
    return KVCacheLayout(num_layers=num_layers,
                         groups=(KVCacheGroup(layers=tuple(range(num_layers)), sliding_window=sliding_window),))


def plan_layout(windows: Sequence[int | None], hybrid: bool = True) -> KVCacheLayout:
    """The groups of layers whose windows are `windows` (None: full attention), as vLLM 0.33
    forms them; hybrid=False: one full-attention group when any layer attends globally."""
    n = len(windows)
    if not hybrid or len(set(windows)) == 1:
        kinds = set(windows)
        return single_group(n, windows[0] if len(kinds) == 1 else None)
    buckets: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        buckets.setdefault(w, []).append(layer)
    sizes = [len(b) for b in buckets.values()]
    size = min(sizes)
    if max(sizes) < size * 1.5:
        size = max(sizes)
    groups = []
    for w, layers in buckets.items():
        k = -(-len(layers) // size)
        groups.extend(KVCacheGroup(layers=tuple(layers[i::k]), sliding_window=w) for i in range(k))
    return KVCacheLayout(num_layers=n, groups=tuple(groups))


def layer_windows(config, max_model_len: int) -> list[int | None]:
    """Each layer's attention window of a model config (`models.model_dir.ModelConfig`); a window
    at least as long as the longest sequence never binds and counts as full attention (the
    model's layers then attend without one)."""
    w = config.sliding_window
    if w is not None and w >= max_model_len:
        w = None
    if config.gemma is not None:
        local = set(config.gemma.sliding_layers)
        return [w if i in local else None for i in range(config.num_layers)]
    return [w] * config.num_layers
