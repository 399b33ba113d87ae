"""The OffloadingConnector's kv_connector_extra_config: declared keys, ranges, and their checks.

The keys are vLLM 0.33's where vLLM has them, with vLLM's meaning (kv_offload/cpu/spec.py,
kv_offload/tiering/spec.py, kv_connector/v1/offloading/config.py), and kvtool's own beside
them (root_dir, fs_capacity_bytes, num_cpu_blocks, offload_block_tokens, layerwise).

spec_name picks vLLM's form: CPUOffloadingSpec (the default) is the CPU tier, to which kvtool's
root_dir adds its disk tier; TieringOffloadingSpec is the CPU tier with `secondary_tiers`
below it, whose one `fs` entry is kvtool's disk tier (secondary_tiers.py). vLLM ignores the
tiering keys under CPUOffloadingSpec; kvtool refuses them there rather than ignore them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvtool.engine.connectors.extra_keys import ExtraKey, parse_extra
from kvtool.engine.connectors.offloading.eviction import POLICY_NAMES
from kvtool.engine.connectors.offloading.secondary_tiers import (
    BACKPRESSURE_REFUSAL,
    MAX_PATH_CHARS,
    parse_secondary_tiers,
)
from kvtool.engine.config.sizes import MAX_SIZE_BYTES, check_fits_memory
from kvtool.engine.errors import ConfigError

CONNECTOR = "OffloadingConnector"
MAX_OFFLOAD_BLOCK_TOKENS = 1 << 20
MAX_CPU_BLOCKS = 1 << 31
MAX_TRACKER_KEYS = 1 << 31
MAX_STORE_THRESHOLD = 1 << 31
SPEC_NAMES = ("CPUOffloadingSpec", "TieringOffloadingSpec")
TIERING_SPEC = "TieringOffloadingSpec"
# vLLM's default for store_threshold's LRU table, and for the pause between tier-poll rounds.
DEFAULT_MAX_TRACKER_SIZE = 64_000
DEFAULT_TIER_POLL_INTERVAL_S = 0.001

OFFLOADING_KEYS: tuple[ExtraKey, ...] = (
    ExtraKey(name="root_dir", kind="str", max_len=MAX_PATH_CHARS,
             doc="the disk tier's directory; without it the connector is CPU-only"),
    ExtraKey(name="cpu_bytes_to_use", kind="size", low=1, high=MAX_SIZE_BYTES,
             doc="bytes of the CPU tier over all tensor-parallel ranks (default 1 GiB unless num_cpu_blocks is set)"),
    ExtraKey(name="num_cpu_blocks", kind="int", low=1, high=MAX_CPU_BLOCKS,
             doc="offload blocks of the CPU tier, instead of cpu_bytes_to_use"),
    ExtraKey(name="fs_capacity_bytes", kind="size", default=0, low=0, high=MAX_SIZE_BYTES,
             doc="most bytes of block files under root_dir; 0 = unlimited"),
    ExtraKey(name="eviction_policy", kind="choice", default="lru", choices=POLICY_NAMES),
    ExtraKey(name="cache_policy_module_path", kind="str",
             refused="kvtool's eviction policies are its own lru and arc; it loads no out-of-tree policy class"),
    ExtraKey(name="offload_block_tokens", kind="int", aliases=("block_size",), low=1, high=MAX_OFFLOAD_BLOCK_TOKENS,
             doc="tokens per offload block, a multiple of the engine block size (default: the block size)"),
    ExtraKey(name="blocks_per_chunk", kind="int", low=1, high=MAX_OFFLOAD_BLOCK_TOKENS,
             doc="engine blocks per offload block, instead of block_size"),
    ExtraKey(name="store_threshold", kind="int", default=0, low=0, high=MAX_STORE_THRESHOLD,
             doc="offers of a chunk before it is stored; below 2: every offer stores"),
    ExtraKey(name="max_tracker_size", kind="int", default=DEFAULT_MAX_TRACKER_SIZE, low=1, high=MAX_TRACKER_KEYS,
             doc="keys store_threshold counts offers for (an LRU table)"),
    ExtraKey(name="offload_prompt_only", kind="bool", default=True),
    ExtraKey(name="group_idx", kind="int", default=0, low=0, high=0,
             doc="0 only: each KV cache group's offload blocks are keyed by the group's own index"),
    ExtraKey(name="layerwise", kind="bool", default=False,
             doc="on CUDA, save (and load any hit) layer by layer during the forward"),
    ExtraKey(name="spec_name", kind="choice", default="CPUOffloadingSpec", choices=SPEC_NAMES),
    ExtraKey(name="spec_module_path", kind="str",
             refused="kvtool implements CPUOffloadingSpec and TieringOffloadingSpec; it loads no out-of-tree "
                     "spec class"),
    ExtraKey(name="secondary_tiers", kind="list",
             doc="TieringOffloadingSpec: at most one {\"type\": \"fs\", \"root_dir\": ...}, kvtool's disk tier"),
    ExtraKey(name="tier_poll_interval_s", kind="float", default=DEFAULT_TIER_POLL_INTERVAL_S,
             doc="TieringOffloadingSpec: vLLM's pause between polls of peer-serving tiers"),
    ExtraKey(name="backpressure", kind="object", refused=BACKPRESSURE_REFUSAL),
    ExtraKey(name="sync_load_budget_bytes", kind="size", default=0, low=0, high=MAX_SIZE_BYTES,
             doc="vLLM's bytes of loads per step done inside the step; kvtool loads every hit inside the step "
                 "that schedules it, whatever the budget"),
    ExtraKey(name="canonical_layout", kind="bool", default=False,
             doc="false only: kvtool's CPU tier keeps its own block-major layout"),
    ExtraKey(name="self_describing_kv_events", kind="bool", default=False,
             doc="false only: kvtool publishes vLLM's BlockStored / BlockRemoved events"),
)
TIERING_ONLY_KEYS = ("secondary_tiers", "tier_poll_interval_s")


class OffloadingSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """kv_connector_extra_config of the OffloadingConnector (vLLM's keys where vLLM has them)."""

    # The disk tier (kvtool's root_dir key, or the fs entry of secondary_tiers); None: CPU-only.
    root_dir: str | None = None
    cpu_bytes_to_use: int | None = None
    num_cpu_blocks: int | None = None
    fs_capacity_bytes: int = 0  # 0 = unlimited
    eviction_policy: Literal["lru", "arc"] = "lru"
    offload_block_tokens: int | None = None  # a multiple of the engine block size
    blocks_per_chunk: int | None = None  # resolved into offload_block_tokens
    # A chunk is stored on its store_threshold-th offer (below 2: the first); offers are counted
    # for the max_tracker_size most recently offered keys (store_filter.py).
    store_threshold: int = 0
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE
    offload_prompt_only: bool = True
    group_idx: int = 0
    # kvtool's key: on CUDA, load and save layer by layer during the forward. Loads go through
    # pitched copies on the copy engine, or the layer kernel where the driver has none and the
    # device can address the pinned pool; saves through the kernel, from LAYERWISE_MIN_BLOCKS blocks.
    layerwise: bool = False
    spec_name: str = "CPUOffloadingSpec"
    secondary_tiers: list | None = None  # resolved into root_dir and the disk_* fields
    # vLLM paces its tier-poll thread with it, a thread it starts only for tiers that serve
    # peers between steps (p2p); its fs tier, like kvtool's disk tier, is serviced once per
    # step, so with the one tier kvtool takes the value changes nothing, in vLLM as here.
    tier_poll_interval_s: float = DEFAULT_TIER_POLL_INTERVAL_S
    # Whether the disk tier's STORAGE KV events are published (when KV events are on): always
    # for root_dir, as the fs tier's enable_kv_events says for secondary_tiers; and the
    # locality those events carry (the fs tier's `locality`).
    disk_events: bool = True
    disk_locality: str | None = None
    # vLLM 0.33 loads hits within this budget inside the step and the rest between steps
    # (WAITING_FOR_REMOTE_KVS); kvtool loads every hit inside the step that schedules it, so
    # the value is accepted and changes nothing.
    sync_load_budget_bytes: int = 0
    # vLLM 0.33's topology-free host layout and its richer KV events: false only (see parse_settings).
    canonical_layout: bool = False
    self_describing_kv_events: bool = False


def parse_settings(extra: dict, engine_block_size: int, kv_bytes_per_block: int | None = None) -> OffloadingSettings:
    """Decode and check the extra config; refuses unknown keys and values outside their range.

    The result has offload_block_tokens resolved (from block_size, blocks_per_chunk or the
    engine block size) and root_dir resolved (from root_dir or secondary_tiers). With
    `kv_bytes_per_block` (bytes of one engine block of KV, over every tensor-parallel rank)
    the CPU tier's size is also checked against the machine's memory, before anything is
    allocated. Raises ConfigError with one line naming the key.
    """
    values = parse_extra(CONNECTOR, OFFLOADING_KEYS, extra)
    s = OffloadingSettings(**values)  # type: ignore[arg-type]
    where = f"invalid {CONNECTOR} config"
    if s.canonical_layout:
        raise ConfigError(f"{where}: canonical_layout true is not supported: kvtool's CPU tier keeps its own "
                          "block-major layout (vLLM's canonical host layout serves vLLM's own tiers)")
    if s.self_describing_kv_events:
        raise ConfigError(f"{where}: self_describing_kv_events true is not supported: kvtool publishes vLLM's "
                          "standard BlockStored / BlockRemoved events")
    tiering = s.spec_name == TIERING_SPEC
    if not tiering:
        for key in TIERING_ONLY_KEYS:
            if key in extra:
                raise ConfigError(f"{where}: {key} is read only with spec_name {TIERING_SPEC!r} (vLLM ignores it "
                                  f"under {s.spec_name!r})")
    elif s.store_threshold >= 2:
        raise ConfigError(f"{where}: store_threshold {s.store_threshold} is not supported with {TIERING_SPEC} "
                          "(as in vLLM); values below 2 turn the filter off")
    obt = _offload_block_tokens(s, engine_block_size, where)
    root_dir, disk_events, disk_locality = s.root_dir, True, None
    fs = parse_secondary_tiers(CONNECTOR, s.secondary_tiers or [])
    if fs is not None:
        if root_dir is not None:
            raise ConfigError(f"{where}: give the disk tier once, as root_dir or as a secondary_tiers fs entry")
        root_dir, disk_events, disk_locality = fs.root_dir, fs.enable_kv_events, fs.locality
    if s.cpu_bytes_to_use is not None:
        check_fits_memory(f"{CONNECTOR} cpu_bytes_to_use", s.cpu_bytes_to_use)
    if s.num_cpu_blocks is not None and kv_bytes_per_block is not None:
        blocks_per_slot = obt // engine_block_size
        check_fits_memory(
            f"{CONNECTOR} num_cpu_blocks {s.num_cpu_blocks}", s.num_cpu_blocks * blocks_per_slot * kv_bytes_per_block
        )
    return msgspec.structs.replace(s, offload_block_tokens=obt, root_dir=root_dir, disk_events=disk_events,
                                   disk_locality=disk_locality)


def _offload_block_tokens(s: OffloadingSettings, engine_block_size: int, where: str) -> int:
    """Tokens per offload block: block_size (offload_block_tokens), blocks_per_chunk engine blocks,
    or one engine block; block_size and blocks_per_chunk exclude each other, as in vLLM."""
    if s.blocks_per_chunk is not None:
        if s.offload_block_tokens is not None:
            raise ConfigError(f"{where}: give one of block_size (offload_block_tokens) or blocks_per_chunk, not both")
        obt = s.blocks_per_chunk * engine_block_size
        if obt > MAX_OFFLOAD_BLOCK_TOKENS:
            raise ConfigError(f"{where}: blocks_per_chunk {s.blocks_per_chunk} makes offload blocks of {obt} tokens, "
                              f"more than {MAX_OFFLOAD_BLOCK_TOKENS}")
        return obt
    obt = s.offload_block_tokens or engine_block_size
    if obt % engine_block_size:
        raise ConfigError(
            f"{where}: offload_block_tokens {obt} is not a multiple of the block size {engine_block_size}; round it "
            f"up to {-(-obt // engine_block_size) * engine_block_size}, or give blocks_per_chunk"
        )
    return obt
