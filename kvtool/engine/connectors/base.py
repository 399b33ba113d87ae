"""The connector API, mirroring vLLM's KVConnectorBase_V1: a scheduler half and a worker half.

The halves share no state: no object, list or tensor is reachable from both. They talk only
through the per-step metadata the scheduler half builds (scheduler -> worker) and the
`KVConnectorOutput` the worker half returns (worker -> scheduler, with its finished jobs as
`completions`), so a worker half could live in another process. The scheduler half alone owns
what is where (tier slots, pins, LRU order, indexes); the worker half moves bytes and reports.
Nothing a scheduler half does may wait on a file system or a socket: it runs inside schedule().

Call order in one engine step, as vLLM calls them:

  scheduler  check_request(req)                   once, when the engine accepts a request
             get_num_new_matched_tokens(req, n)   per waiting request; may repeat; no side effects
             update_state_after_alloc(req, ids, k) after blocks were allocated for it
             build_connector_meta(sched_out)      once, at the end of schedule()
  worker     bind_connector_metadata(meta)
             start_load_kv()                      before the forward (loads are synchronous)
             wait_for_layer_load(l) / save_kv_layer(l)   around each layer's attention
             wait_for_save()                      after the forward
             get_finished(finished_ids), get_block_ids_with_load_errors(), take_stats(),
             take_completions()
             clear_connector_metadata()
  scheduler  update_connector_output(out)         with the worker's output
             request_finished(req, ids)           once per finished request, before its blocks are freed
"""

from __future__ import annotations

import abc
import threading
from typing import TYPE_CHECKING, ClassVar

import msgspec

from kvtool.engine.connectors.config import KVTransferConfig
from kvtool.engine.connectors.steps_in_flight import StepsInFlight
from kvtool.engine.errors import ConfigError
from kvtool.engine.kv.groups import KVCacheLayout, single_group
from kvtool.engine.kv.pages import KVGeometry, KVPages
from kvtool.engine.core.messages import (
    KVConnectorCompletions,
    KVConnectorMetadata,
    KVConnectorOutput,
    SchedulerOutput,
    TransferStats,
)
from kvtool.engine.models.shard_layout import TPRank, kv_head_range
from kvtool.engine.outputs import CPUTierUsage

if TYPE_CHECKING:
    from kvtool.engine.core.request import Request

__all__ = [
    "ConnectorContext",
    "EngineIdentity",
    "KVConnector",
    "KVConnectorCompletions",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "SchedulerHalf",
    "StepsInFlight",
    "TransferStats",
    "WorkerHalf",
    "identity_of_rank",
]


class EngineIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What the running engine is: connectors stamp and check stored KV against it."""

    model_name: str  # the --model string as given
    architecture: str
    config_digest: str
    weights_digest: str
    rope_digest: str
    sliding_window: int
    weight_quantization: str
    kv_dtype: str
    kv_quantization: str
    geometry: KVGeometry
    block_hash_algo: str  # the engine's prefix-cache hash ("sha256_cbor")
    none_hash_seed: str
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    engine_id: str = ""
    device_type: str = "cpu"
    # The model's KV heads over all ranks (geometry.num_kv_heads is this rank's shard); 0: unknown,
    # which only a TP-1 identity may be. A scheduler half derives every rank's shard from it.
    model_num_kv_heads: int = 0


def identity_of_rank(identity: EngineIdentity, size: int, rank: int) -> EngineIdentity:
    """The identity of rank `rank` of a TP-`size` engine, from the engine's or any rank's identity.

    The rank's KV heads are shard_layout's split of `model_num_kv_heads`, when `identity` itself
    holds its own share of them; an identity holding every head (a replicated, unsharded model)
    gives every rank every head. Raises ConfigError for a TP>1 identity that does not know the
    model's KV heads.
    """
    total = identity.model_num_kv_heads
    if not total:
        if identity.tp_size != 1:
            raise ConfigError("a tensor-parallel engine identity needs model_num_kv_heads")
        total = identity.geometry.num_kv_heads
    own = kv_head_range(total, TPRank(identity.tp_size, identity.tp_rank))[1]
    sharded = identity.geometry.num_kv_heads == own
    heads = kv_head_range(total, TPRank(size, rank))[1] if sharded else identity.geometry.num_kv_heads
    geometry = msgspec.structs.replace(identity.geometry, num_kv_heads=heads)
    return msgspec.structs.replace(identity, tp_size=size, tp_rank=rank, geometry=geometry, model_num_kv_heads=total)


class ConnectorContext(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a connector half is built from."""

    config: KVTransferConfig
    identity: EngineIdentity
    none_hash: bytes
    # The engine's KV cache groups (None: one full-attention group of every layer).
    layout: KVCacheLayout | None = None

    @property
    def kv_layout(self) -> KVCacheLayout:
        return self.layout if self.layout is not None else single_group(self.identity.geometry.num_layers)


class SchedulerHalf(abc.ABC):
    """Decides what can be loaded and what should be stored. Never touches a tensor."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        # The metadata of each step not answered yet: a half that must know which jobs an
        # output's failures belong to records each step's metadata here in build_connector_meta
        # and takes it back with `answered(output)` in update_connector_output.
        self.steps_in_flight: StepsInFlight = StepsInFlight()

    def check_request(self, request: Request) -> None:
        """Called by `add_request` before the request is queued: raise InputError for a request
        this connector cannot serve (e.g. an LMCache tag its keys cannot carry). Default: accept.
        """

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` (the block-aligned local hit) that can be loaded.

        Called for each waiting request the scheduler tries to admit, possibly several times:
        must have no side effects. Returns (count, load_async); count None means "ask again later".
        kvtool loads synchronously, so load_async is always False. Only a prefix that is really
        available may be counted; a consumer-less role (kv_producer) always returns 0.
        """

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Called once blocks were allocated for an admitted request; decide the load from num_external_tokens.

        At this call request.num_computed_tokens is the local prefix-cache hit, so the external
        tokens to load are [num_computed_tokens, num_computed_tokens + num_external_tokens), in
        block_ids. Called again if a preempted request is admitted anew.
        """

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Called once at the end of every schedule(); must not modify scheduler_output.

        The metadata is for step `scheduler_output.step_id`; under async scheduling the next step
        is built before this one's output is back, so per-step state is kept by step id
        (`self.steps_in_flight`), never in one "current step" field.
        """

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Called every step with the worker half's output for step `output.step_id` (None: a
        report of background work between steps, e.g. after a flush)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Called once when a request finishes, before its blocks are freed.

        Returns (keep_blocks, kv_transfer_params): True keeps the blocks alive until the worker
        reports the request in finished_sending.
        """
        return False, None

    def kv_event_recorder(self):
        """Start recording vLLM KV events for the tiers this half indexes, and return the recorder
        (a `kv_events.OffloadEventRecorder`) the engine drains each step; None: no tiers of its own."""
        return None

    def cpu_tier_usage(self) -> CPUTierUsage | None:
        """How the CPU tier this half indexes is used now (read by the engine's stats()); None: no CPU tier."""
        return None

    def reset_cache(self) -> bool:
        """Forget what this half's own host-memory tier holds (vLLM's `reset_cache`, behind
        `POST /reset_prefix_cache?reset_external=true`); called between steps, never inside one.

        Stores that outlive the process (a disk tier, a remote store) are never wiped. Returns
        False when something is still held (a transfer in flight pins its slot): the caller may
        retry once the engine has stepped. Default: nothing of its own to forget.
        """
        return True

    def shutdown(self) -> None:
        """Release resources; called once when the engine closes."""


class WorkerHalf(abc.ABC):
    """Moves bytes between the KV pages and the store, around each forward."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.kv_pages: KVPages | None = None
        self._meta: KVConnectorMetadata | None = None
        # Load failures of the current step by block id (with a reason), and the counters since
        # the last take_stats; a half that counts from another thread takes _stats_lock.
        self.errors: dict[int, str] = {}
        self.stats = TransferStats()
        self._stats_lock = threading.Lock()

    def register_kv_caches(self, kv_pages: KVPages) -> None:
        """Called once, after the KV pages are allocated."""
        self.kv_pages = kv_pages

    def bind_connector_metadata(self, meta: KVConnectorMetadata) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    @abc.abstractmethod
    def start_load_kv(self) -> None:
        """Load this step's external KV into the pages. Called before the forward."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Called before layer `layer` reads the pages (layerwise connectors wait here)."""

    def save_kv_layer(self, layer: int) -> None:
        """Called after layer `layer` wrote its K/V for the step."""

    def has_layer_work(self) -> bool:
        """Whether this step needs wait_for_layer_load / save_kv_layer (the forward then runs
        eagerly, layer by layer, instead of a captured graph). Default: whenever the half
        overrides either of them."""
        cls = type(self)
        return cls.wait_for_layer_load is not WorkerHalf.wait_for_layer_load or cls.save_kv_layer is not WorkerHalf.save_kv_layer

    def order_page_writes(self, block_ids) -> None:
        """Called before each forward with the page blocks it will write (an int array).

        A half that still reads pages asynchronously (a store copying on its own stream) must
        make those writes wait for its reads of the same blocks here.
        """

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Called once per step after the forward: store (or queue) newly completed blocks.

        Copies out of the pages must either finish before this returns, or stay ordered before
        any later write to the same blocks through `order_page_writes`: blocks may be freed and
        reused in the very next step.
        """

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving) since the last call; synchronous connectors: (None, None)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> dict[int, str]:
        """Blocks whose load failed this step, with a reason each; reported once."""
        errors, self.errors = self.errors, {}
        return errors

    def take_completions(self) -> KVConnectorCompletions | None:
        """Jobs finished since the last call (by id), for the scheduler half; None when nothing to report."""
        return None

    def take_stats(self) -> TransferStats:
        """Counters since the last call."""
        with self._stats_lock:
            stats, self.stats = self.stats, TransferStats()
        return stats

    def flush(self) -> None:
        """Wait until every store queued so far has landed in the store (disk writes, remote PUTs)."""

    def shutdown(self) -> None:
        """Finish pending stores and release resources; called once when the engine closes."""


class KVConnector:
    """A registered connector: its two halves, and the device types its worker half can move bytes on."""

    scheduler_half: ClassVar[type[SchedulerHalf]]
    worker_half: ClassVar[type[WorkerHalf] | None] = None
    worker_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    @classmethod
    def groups_unsupported(cls, config: KVTransferConfig) -> str | None:
        """Why this connector, so configured, moves one KV cache group only, or None where it
        stores and loads every group (vLLM's `SupportsHMA`). The engine keeps one group for a
        connector that gives a reason, as vLLM turns its hybrid manager off for it."""
        return "does not support the hybrid KV cache manager (as in vLLM)"

    @classmethod
    def create_scheduler_half(cls, ctx: ConnectorContext) -> SchedulerHalf:
        """The scheduler half alone, as the engine process builds it (no worker half needed)."""
        return cls.scheduler_half(ctx)

    @classmethod
    def create_worker_half(cls, ctx: ConnectorContext) -> WorkerHalf | None:
        """The worker half alone, as a worker process builds it (no scheduler half needed)."""
        return cls.worker_half(ctx) if cls.worker_half is not None else None

    # ---- what the connector says of itself (callers never re-derive its defaults or aliases) ----

    @classmethod
    def hit_unit_tokens(cls, config: KVTransferConfig, block_size: int) -> int:
        """The granularity at which it serves a prefix (engine blocks, offload blocks, chunks)."""
        return block_size

    @classmethod
    def outlives_engine(cls, config: KVTransferConfig) -> bool:
        """Whether the KV it holds survives the engine (a disk tier, a remote store)."""
        return True

    @classmethod
    def hit_source(cls, config: KVTransferConfig, rebuilt: bool) -> str:
        """Where its hits come from, for reports (after an engine rebuild when `rebuilt`)."""
        return config.kv_connector or cls.__name__

    @classmethod
    def worker_refusal(cls, device_type: str) -> str | None:
        """Why the worker half cannot run on this device type, or None when it can."""
        if cls.worker_half is None:
            return "it has a scheduler half but no worker half"
        if device_type not in cls.worker_devices:
            return f"its worker half moves bytes only on {', '.join(cls.worker_devices)}"
        return None
