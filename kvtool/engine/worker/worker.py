"""One rank's execution state: its model (shard), KV pages, connector worker half and runner.

`build_worker` makes one. The engine's own process holds one at tensor-parallel size 1
(executor/executor.py's InProcessExecutor); at size N each rank's process holds one (executor/rank_process.py), so
a rank is built the same way wherever it runs. Life of a worker, driven by its executor:

    build_worker             the rank's model on its device (seeded from --seed)
    determine_available_memory   bytes its KV pages may take (the engine takes the least of all ranks)
    init_cache(num_blocks)   KV pages, the connector's worker half (the rank's identity), the runner
    execute_async(so)        one step (ModelRunner.execute_async)
    flush_connector(take)    the worker half's background stores land; optionally its completions
    shutdown()               the worker half writes what is pending and releases its resources
"""

from __future__ import annotations

import torch

from kvtool.engine.connectors.base import ConnectorContext, EngineIdentity, WorkerHalf, identity_of_rank
from kvtool.engine.core.messages import KVConnectorCompletions, SchedulerOutput
from kvtool.engine.kv.cache_size import kv_cache_layout, rank_kv_geometry
from kvtool.engine.kv.identity import kv_cache_scales, resolve_kv_dtype
from kvtool.engine.kv.pages import KVPages
from kvtool.engine.kv.scales import KVScales
from kvtool.engine.models.fast_paths import FastPaths, apply_fast_paths
from kvtool.engine.models.shard_layout import TPRank
from kvtool.engine.params import EngineParams
from kvtool.engine.worker.model_runner import ModelRunner, PendingOutput


class Worker:
    """The model, KV pages, connector worker half and runner of one rank."""

    def __init__(self, model, model_config, params: EngineParams, device: torch.device, dtype: torch.dtype,
                 tp: TPRank, max_model_len: int, identity: EngineIdentity | None, none_hash: bytes,
                 kv_scales: KVScales | None = None) -> None:
        self.model = model
        self.params = params
        self.device = device
        self.tp = tp
        self.max_model_len = max_model_len
        # The engine's identity (None without a connector); the worker half gets the rank's.
        self.identity = identity
        self.none_hash = none_hash
        self.geometry = rank_kv_geometry(model_config, params.block_size, resolve_kv_dtype(params.kv_cache_dtype, dtype),
                                         tp)
        self.kv_scales = kv_scales  # an fp8 cache's (None: the model's dtype)
        self.kv_layout = kv_cache_layout(params, model_config, max_model_len)  # the engine's groups
        # Built by init_cache.
        self.kv_pages: KVPages | None = None
        self.connector: WorkerHalf | None = None
        self.runner: ModelRunner | None = None
        self.fast_paths: FastPaths | None = None  # what apply_fast_paths chose for the model

    def determine_available_memory(self) -> int:
        """Bytes this rank's KV pages may take: on CUDA what --gpu-memory-utilization leaves of the
        device's memory beside the model, else --kv-cache-memory."""
        p = self.params
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free - (1.0 - p.gpu_memory_utilization) * total)
        return p.kv_cache_memory

    def init_cache(self, num_blocks: int) -> None:
        """Allocate the KV pages, build the connector's worker half and the runner over them."""
        from kvtool.engine.connectors.registry import resolve_connector

        p = self.params
        scales = self.kv_scales
        self.kv_pages = KVPages(self.geometry, num_blocks, self.device, scales and scales.k, scales and scales.v,
                                layout=self.kv_layout)
        ktc = p.kv_transfer_config
        if self.identity is not None and ktc is not None and ktc.kv_connector is not None:
            identity = identity_of_rank(self.identity, self.tp.size, self.tp.rank)
            ctx = ConnectorContext(config=ktc, identity=identity, none_hash=self.none_hash, layout=self.kv_layout)
            self.connector = resolve_connector(ktc).create_worker_half(ctx)
        # Fused kernels and packed weights free the unfused ones: applied after the pages are
        # sized, so the freed memory is not counted as the model's.
        self.fast_paths = apply_fast_paths(self.model, self.device, self.kv_pages.tensor.dtype,
                                           backend=p.attention_backend)
        self.runner = ModelRunner(
            self.model, self.kv_pages, self.device, self.fast_paths, self.connector, max_model_len=self.max_model_len,
            use_cuda_graphs=not p.enforce_eager, backend=p.attention_backend,
            batch_invariant=p.batch_invariant, max_num_seqs=p.max_num_seqs,
        )
        if p.calculate_kv_scales:  # after the runner's warm-up steps, whose K/V are no request's
            self.kv_pages.calculate_scales_from_next_kv()

    def execute_async(self, so: SchedulerOutput) -> PendingOutput:
        return self.runner.execute_async(so)

    @property
    def request_ids(self) -> list[str]:
        """The requests whose state the runner holds."""
        return self.runner.request_ids if self.runner is not None else []

    def flush_connector(self, take_completions: bool) -> KVConnectorCompletions | None:
        """Wait for the worker half's background stores; with take_completions, what it finished."""
        if self.connector is None:
            return None
        self.connector.flush()
        return self.connector.take_completions() if take_completions else None

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()


def build_worker(params: EngineParams, model_dir, device: torch.device, dtype: torch.dtype, tp: TPRank,
                 max_model_len: int, identity: EngineIdentity | None, none_hash: bytes) -> Worker:
    """One rank's worker with its model built (dummy weights are seeded from --seed)."""
    from kvtool.engine.models import build_model

    torch.manual_seed(params.seed)
    model = build_model(model_dir, device, dtype, params.load_format, params.seed, tp=tp,
                        max_model_len=max_model_len)
    scales = kv_cache_scales(params, model_dir, resolve_kv_dtype(params.kv_cache_dtype, dtype))
    return Worker(model, model_dir.config, params, device, dtype, tp, max_model_len, identity, none_hash, scales)
