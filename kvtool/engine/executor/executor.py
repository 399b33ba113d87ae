"""What runs the engine's steps: one Executor, in this process or over N rank processes.

The engine holds one Executor and drives it the same way at every tensor-parallel size:

    determine_available_memory()  bytes each rank's KV pages may take (the engine sizes the cache
                                  from the least of them)
    init_cache(num_blocks)        every rank allocates its KV pages, its connector worker half and
                                  its runner
    execute(so) / execute_async(so).result()   one step -> ModelRunnerOutput
    flush_connector(take_completions)          the worker halves' stores land; what they finished
    request_ids                   the requests whose state the runners hold (check_integrity)
    failure                       the error that broke a rank group, or None
    close()                       the worker halves write pending stores and stop; idempotent

`InProcessExecutor` (tensor-parallel size 1) runs one Worker (worker/worker.py) in the engine's
process; `MultiprocExecutor` (multiprocess.py, size N > 1) runs one per rank process.
`build_executor` picks one; no other module needs to know which.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvtool.engine.connectors.base import EngineIdentity
from kvtool.engine.core.messages import KVConnectorCompletions, ModelRunnerOutput, SchedulerOutput
from kvtool.engine.errors import ConfigError, KVToolError
from kvtool.engine.models.shard_layout import TPRank, check_tp_fits
from kvtool.engine.params import EngineParams
from kvtool.engine.worker.model_runner import PendingOutput
from kvtool.engine.worker.worker import Worker, build_worker


class PendingStep(Protocol):
    """A step handed to the executor; result() waits for it."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(Protocol):
    """Runs the engine's steps on the model's ranks (see the module docstring)."""

    @property
    def failure(self) -> KVToolError | None: ...

    @property
    def request_ids(self) -> list[str]: ...

    def determine_available_memory(self) -> list[int]: ...

    def init_cache(self, num_blocks: int) -> None: ...

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_async(self, so: SchedulerOutput) -> PendingStep: ...

    def flush_connector(self, take_completions: bool) -> KVConnectorCompletions | None: ...

    def close(self) -> None: ...


class InProcessExecutor:
    """One worker in the engine's own process (tensor-parallel size 1)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._closed = False

    @property
    def failure(self) -> KVToolError | None:
        return None  # an error here is raised by the call that met it

    @property
    def request_ids(self) -> list[str]:
        return self.worker.request_ids

    def determine_available_memory(self) -> list[int]:
        return [self.worker.determine_available_memory()]

    def init_cache(self, num_blocks: int) -> None:
        self.worker.init_cache(num_blocks)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(so).result()

    def execute_async(self, so: SchedulerOutput) -> PendingOutput:
        return self.worker.execute_async(so)

    def flush_connector(self, take_completions: bool) -> KVConnectorCompletions | None:
        return self.worker.flush_connector(take_completions)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.worker.shutdown()


def check_parallelism(config, params: EngineParams, device: torch.device) -> None:
    """Refuse a tensor-parallel size the model's heads or the machine's devices cannot take."""
    size = params.tensor_parallel_size
    check_tp_fits(config.num_heads, config.num_kv_heads, size)
    if size > 1 and device.type == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(f"--tensor-parallel-size {size} needs {size} CUDA devices, found {torch.cuda.device_count()}")


def build_executor(params: EngineParams, model_dir, device: torch.device, dtype: torch.dtype, max_model_len: int,
                   identity: EngineIdentity | None, none_hash: bytes) -> Executor:
    """The executor for params.tensor_parallel_size, its ranks' models built (their start-up errors
    raised as one line). `identity` is the engine's (None without a connector)."""
    size = params.tensor_parallel_size
    if size == 1:
        return InProcessExecutor(build_worker(params, model_dir, device, dtype, TPRank(), max_model_len, identity,
                                              none_hash))
    from kvtool.engine.executor.multiprocess import start_multiproc_executor

    return start_multiproc_executor(params, model_dir.path, device, dtype, max_model_len, identity, none_hash)
