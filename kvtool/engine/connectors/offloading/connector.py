"""OffloadingConnector: a CPU tier and an optional disk tier, as vLLM splits its offloading connector.

The scheduler half (scheduler.py) owns what is where: the CPU slot index and an in-memory index
of the disk tier. The worker half (worker.py) owns the bytes: the host pool and the disk files.
Stores copy newly completed prompt blocks into the CPU tier after the forward and write them
through to disk on a background thread, off the critical path. Under tensor parallelism each
rank's worker half moves its own KV-head shard into its own identity's directory, and the
scheduler half counts a block only when every rank has it. This module holds the settings,
the disk identity and the facade that builds each half.
"""

from __future__ import annotations

import logging

from kvtool.engine.connectors.base import ConnectorContext, EngineIdentity, KVConnector, identity_of_rank
from kvtool.engine.connectors.offloading.cpu_tier import HostPool, plan_num_slots
from kvtool.engine.connectors.offloading.disk.disk_index import DiskIndex
from kvtool.engine.connectors.offloading.disk.disk_tier import DiskTier
from kvtool.engine.connectors.offloading.disk.group_tiers import (
    GroupDiskIndex,
    GroupDiskTiers,
    block_hash_of,
    group_identities,
)
from kvtool.engine.connectors.offloading.disk.tier_identity import KVIdentity, make_identity
from kvtool.engine.connectors.offloading.scheduler import OffloadingScheduler
from kvtool.engine.connectors.offloading.settings import OffloadingSettings, parse_settings
from kvtool.engine.connectors.offloading.worker import OffloadingWorker

logger = logging.getLogger("kvtool.offloading")

DEFAULT_CPU_BYTES = 1 << 30

__all__ = ["OffloadingConnector", "OffloadingSettings", "block_hash_of", "disk_identity", "group_identities",
           "parse_settings"]


def disk_identity(identity: EngineIdentity, offload_block_tokens: int) -> KVIdentity:
    """The identity header every disk-tier file of this engine carries."""
    return make_identity(
        model_name=identity.model_name,
        config_digest=identity.config_digest,
        weights_digest=identity.weights_digest,
        architecture=identity.architecture,
        geometry=identity.geometry,
        offload_block_tokens=offload_block_tokens,
        none_hash_seed=identity.none_hash_seed,
        rope_digest=identity.rope_digest,
        engine_id=identity.engine_id or "kvtool",
        hash_algorithm=identity.block_hash_algo,
        sliding_window=identity.sliding_window or None,
        weight_quantization=identity.weight_quantization,
        kv_quantization=identity.kv_quantization,
        tp_size=identity.tp_size,
        tp_rank=identity.tp_rank,
        pp_size=identity.pp_size,
    )


class OffloadingConnector(KVConnector):
    """A thin facade: each half is built on its own from the config, sharing nothing.

    Both size the CPU pool from the same settings, so a slot number means the same on both sides.
    """

    scheduler_half = OffloadingScheduler
    worker_half = OffloadingWorker

    @classmethod
    def groups_unsupported(cls, config) -> str | None:
        return None

    @staticmethod
    def _plan(ctx: ConnectorContext) -> tuple[OffloadingSettings, int, int]:
        identity = ctx.identity
        geometry = identity.geometry
        # cpu_bytes_to_use counts every rank's share, as vLLM's does: a slot costs one offload
        # block of every rank's KV-head shard.
        # With KV cache groups a block (and a slot's block) holds one group's layers.
        size, slots = identity.tp_size, ctx.kv_layout.num_slots
        bytes_per_block = (sum(identity_of_rank(identity, size, r).geometry.block_bytes(slots) for r in range(size))
                           if size > 1 else geometry.block_bytes(slots))
        settings = parse_settings(dict(ctx.config.kv_connector_extra_config), geometry.block_size,
                                  kv_bytes_per_block=bytes_per_block)
        blocks_per_slot = settings.offload_block_tokens // geometry.block_size
        cpu_bytes = settings.cpu_bytes_to_use
        if cpu_bytes is None and settings.num_cpu_blocks is None:
            cpu_bytes = DEFAULT_CPU_BYTES
        num_slots = plan_num_slots(bytes_per_block * blocks_per_slot, cpu_bytes, settings.num_cpu_blocks)
        return settings, blocks_per_slot, num_slots

    @classmethod
    def hit_unit_tokens(cls, config, block_size: int) -> int:
        return parse_settings(dict(config.kv_connector_extra_config), block_size).offload_block_tokens

    @classmethod
    def outlives_engine(cls, config) -> bool:
        return bool(parse_settings(dict(config.kv_connector_extra_config), 1).root_dir)

    @classmethod
    def hit_source(cls, config, rebuilt: bool) -> str:
        return "disk" if rebuilt and cls.outlives_engine(config) else "cpu"

    @classmethod
    def create_scheduler_half(cls, ctx: ConnectorContext) -> OffloadingScheduler:
        settings, _, num_slots = cls._plan(ctx)
        index = None
        if settings.root_dir:
            # Each rank writes its own shard under its own identity's directory, and each KV cache
            # group under its own: a group's index holds a block only when every rank's directory has it.
            size = ctx.identity.tp_size
            ranks = [identity_of_rank(ctx.identity, size, r) for r in range(size)] if size > 1 else [ctx.identity]
            per_rank = [group_identities(disk_identity(i, settings.offload_block_tokens), ctx.kv_layout) for i in ranks]
            index = GroupDiskIndex([DiskIndex(settings.root_dir, [groups[g] for groups in per_rank])
                                    for g in range(ctx.kv_layout.num_groups)])
        return OffloadingScheduler(ctx, settings, num_slots, index)

    @classmethod
    def create_worker_half(cls, ctx: ConnectorContext) -> OffloadingWorker:
        settings, blocks_per_slot, num_slots = cls._plan(ctx)
        identity = ctx.identity
        pool = HostPool(identity.geometry, blocks_per_slot, num_slots, pin_memory=identity.device_type == "cuda",
                        layers_per_block=ctx.kv_layout.num_slots)
        disk = None
        if settings.root_dir:
            tiers: list[DiskTier] = []
            try:
                for group_identity in group_identities(disk_identity(identity, settings.offload_block_tokens),
                                                       ctx.kv_layout):
                    tiers.append(DiskTier(settings.root_dir, group_identity, settings.fs_capacity_bytes))
            except BaseException:
                for tier in tiers:
                    tier.close()
                raise
            disk = GroupDiskTiers(tiers)
        return OffloadingWorker(ctx, settings, pool, disk)
