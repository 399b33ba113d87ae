"""The public engine: build from a model directory and EngineParams, add requests, step, generate."""

from __future__ import annotations

import array
import itertools
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import torch

from kvtool import __version__
from kvtool.engine.connectors.base import ConnectorContext, identity_of_rank
from kvtool.engine.connectors.registry import refuse_unrunnable_connector, resolve_connector
from kvtool.engine.core.hashing import make_none_hash, uint32_ids
from kvtool.engine.core.messages import KVConnectorOutput
from kvtool.engine.core.output_processor import OutputProcessor
from kvtool.engine.core.request import Request
from kvtool.engine.core.scheduler import Scheduler
from kvtool.engine.core.structured_output import StructuredOutputs
from kvtool.engine.errors import ConfigError, InputError
from kvtool.engine.executor.executor import Executor, build_executor, check_parallelism
from kvtool.engine.kv.cache_size import kv_cache_layout, num_kv_blocks
from kvtool.engine.kv.identity import engine_identity, resolve_device, resolve_dtype, resolve_kv_dtype
from kvtool.engine.models import MODEL_CLASSES
from kvtool.engine.outputs import EngineStats, RequestOutput, RequestResult, StepTimes
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.engine.presets.default_model import resolve_model_path


Progress = Callable[[str, float], None]

# How long step() waits when every waiting request waits for an asynchronous connector lookup.
LOOKUP_POLL_S = 0.001


def token_id_list(ids: Sequence[int]) -> tuple[list[int], int, int, np.ndarray | None]:
    """(the prompt as a list of Python ints, its smallest id, its largest, the same ids as one
    uint32 array or None). A list or tuple of integers of any kind (int, bool, NumPy's) goes
    through one C array (uint32 for a real vocabulary's ids, else int64), which also gives min
    and max in C, faster than int() on every id of a long prompt. Anything else (a
    float or a string of digits among the ids, an id past 64 bits, another kind of sequence)
    goes through int() on every id, as it always did."""
    if isinstance(ids, (list, tuple)):
        u32 = uint32_ids(ids)
        values = u32
        if values is None:
            try:
                values = np.frombuffer(array.array("q", ids), dtype=np.int64)
            except (TypeError, OverflowError):
                pass
        if values is not None:
            return values.tolist(), int(values.min()), int(values.max()), u32
    token_ids = list(map(int, ids))
    return token_ids, min(token_ids), max(token_ids), None


class LLMEngine:
    """One model, one KV cache, one scheduler, optionally one connector.

    Nothing here prints; results come back as msgspec Structs.
    """

    def __init__(self, params: EngineParams, progress: Progress | None = None) -> None:
        from kvtool.engine.models.model_dir import open_model_dir

        self.params = params
        self.device = resolve_device(params.device)
        self.dtype = resolve_dtype(params.dtype, self.device)
        ktc = params.kv_transfer_config
        connector_cls = None
        if ktc is not None and ktc.kv_connector is not None:
            # Refuse an unrunnable connector before anything is loaded or run.
            connector_cls = resolve_connector(ktc)
            refuse_unrunnable_connector(connector_cls, ktc.kv_connector, self.device.type)

        self.model_dir = open_model_dir(resolve_model_path(params.model, progress))
        self.tokenizer = self.model_dir.tokenizer
        cfg = self.model_dir.config
        self.model_config = cfg
        self.max_model_len = params.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        self.kv_dtype = resolve_kv_dtype(params.kv_cache_dtype, self.dtype)
        if params.calculate_kv_scales and self.kv_dtype.itemsize == 1 and connector_cls is not None:
            raise ConfigError("--calculate-kv-scales with a KV connector: scales computed from the first batch "
                              "cannot be named in the identity of stored KV (use the checkpoint's scales)")
        if self.device.type == "cuda" and not MODEL_CLASSES[cfg.architecture].cuda_fused_forwards:
            raise ConfigError(f"{self.model_dir.path}: {cfg.architecture} runs on --device cpu only so far (no CUDA "
                              f"kernels for its layers yet)")
        check_parallelism(cfg, params, self.device)
        self.none_hash = make_none_hash()
        self.identity = None
        if connector_cls is not None:
            self.identity = engine_identity(params, self.model_dir, self.dtype, self.device.type)
        # The KV cache groups (the workers form the same from the same parameters).
        self.kv_layout = kv_cache_layout(params, cfg, self.max_model_len)
        # The model, its KV pages and the connector's worker half live in the executor's workers
        # (here, or one process per rank); this process keeps the scheduler and the scheduler half.
        self.executor: Executor = build_executor(params, self.model_dir, self.device, self.dtype, self.max_model_len,
                                                 self.identity, self.none_hash)
        self.structured = StructuredOutputs(self.tokenizer.backend.to_str, cfg.vocab_size, list(cfg.eos_token_ids))
        self.scheduler: Scheduler | None = None
        try:
            available = self.executor.determine_available_memory()
            self.num_blocks = num_kv_blocks(params, cfg, self.kv_dtype, self.max_model_len, available, self.kv_layout)
            self.executor.init_cache(self.num_blocks)
            self.scheduler = self._build_scheduler(connector_cls, self.num_blocks)
            self.kv_events = self._open_kv_events()
        except BaseException:
            self.executor.close()
            if self.scheduler is not None and self.scheduler.connector is not None:
                self.scheduler.connector.shutdown()
            raise
        self.output_processor = OutputProcessor(self.tokenizer, self.structured, self.scheduler)
        self.async_scheduling = (
            params.async_scheduling if params.async_scheduling is not None else self.device.type == "cuda"
        )
        # Under async scheduling: the step the device is running (its message and its pending result).
        self._in_flight = None
        self._step_times = StepTimes()
        self._ids = itertools.count()
        # Seeds for requests that bring none: reproducible from --seed, independent of batching.
        self._seeds = torch.Generator().manual_seed(params.seed)
        self._closed = False

    def _build_scheduler(self, connector_cls, num_blocks: int) -> Scheduler:
        """The scheduler over num_blocks blocks, with the connector's scheduler half (built on its
        own: the halves share nothing but the config and the store) under rank 0's identity."""
        params, ktc = self.params, self.params.kv_transfer_config
        scheduler_half = None
        if connector_cls is not None:
            identity = identity_of_rank(self.identity, params.tensor_parallel_size, 0)
            scheduler_half = connector_cls.create_scheduler_half(
                ConnectorContext(config=ktc, identity=identity, none_hash=self.none_hash, layout=self.kv_layout))
        return Scheduler(
            num_blocks=num_blocks,
            block_size=params.block_size,
            max_num_batched_tokens=params.max_num_batched_tokens,
            max_num_seqs=params.max_num_seqs,
            enable_prefix_caching=params.enable_prefix_caching,
            none_hash=self.none_hash,
            connector=scheduler_half,
            kv_load_failure_policy=ktc.kv_load_failure_policy if ktc else "fail",
            structured_outputs=self.structured,
            layout=self.kv_layout,
        )

    def _open_kv_events(self):
        """KV events (kv_events.py): the block pool records, step() publishes one batch; None when off."""
        params = self.params
        if params.kv_events_config is None:
            return None
        # pyzmq is loaded only by an engine that publishes.
        from kvtool.engine.events.publisher import open_kv_event_stream

        kv_events = open_kv_event_stream(params.kv_events_config, params.block_size)
        if kv_events is not None:
            kv_events.attach(self.scheduler.pool, self.kv_layout)
            half = self.scheduler.connector
            recorder = half.kv_event_recorder() if half is not None else None
            if recorder is not None:
                kv_events.recorders.append(recorder)
        return kv_events

    # ---- requests -----------------------------------------------------------------------------

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> str:
        """Queue a request; raises InputError for an empty, too long or unschedulable prompt."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InputError("the prompt is empty")
        vocab = self.model_config.vocab_size
        token_ids, lowest, highest, u32 = token_id_list(prompt_token_ids)
        if lowest < 0 or highest >= vocab:  # the loop only names the id
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise InputError(f"token id {bad} is out of range for a vocabulary of {vocab}")
        if n >= self.max_model_len:
            raise InputError(
                f"the prompt ({n} tokens) does not fit the maximum model length of {self.max_model_len} "
                "tokens with room for one output token"
            )
        max_tokens = min(sampling.max_tokens, self.max_model_len - n)
        blocks = self.scheduler.tables.max_blocks(n + max_tokens, self.params.max_num_batched_tokens)
        usable = self.scheduler.pool.num_usable_blocks
        if blocks > usable:
            raise InputError(
                f"the request needs {blocks} KV blocks ({n} prompt + {max_tokens} output tokens) but the "
                f"KV cache holds {usable}; raise --kv-cache-memory or --num-gpu-blocks, "
                "or lower max_tokens"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests:
            raise InputError(f"request id {rid!r} is already in use")
        largest = sampling.largest_token_id()
        if largest >= vocab:
            raise InputError(f"token id {largest} in the sampling parameters is out of range for a vocabulary of {vocab}")
        if sampling.seed is not None:
            seed = sampling.seed
        else:
            seed = int(torch.randint(0, 1 << 62, (1,), generator=self._seeds))
        req = Request(
            rid,
            token_ids,
            sampling,
            max_tokens=max_tokens,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
            seed=seed,
            cache_salt=cache_salt,
            prompt_ids=u32,
            kv_transfer_params=kv_transfer_params,
        )
        if self.scheduler.connector is not None:
            self.scheduler.connector.check_request(req)
        if sampling.structured_outputs is not None:
            self.structured.add(rid, sampling.structured_outputs)
        self.scheduler.add_request(req)
        return rid

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self.structured.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def _schedule(self):
        so = self.scheduler.schedule()
        if so.is_empty and self.scheduler.num_lookups_pending and not self.scheduler.failed_outputs:
            # Every waiting request waits for an asynchronous connector lookup: nothing to run yet.
            time.sleep(LOOKUP_POLL_S)
        return so

    def step(self) -> list[RequestOutput]:
        """Run one engine step. Returns what changed for each request that produced a token or ended.

        Under async scheduling the step schedules and queues the next batch first, then waits for
        the batch already on the device and reports it: the host schedules while the device computes.
        """
        times = self._step_times
        times.steps += 1
        t0 = time.perf_counter()
        if not self.async_scheduling:
            so = self._schedule()
            t1 = time.perf_counter()
            result = self.executor.execute(so)  # launches and waits: counted as the launch
            t2 = time.perf_counter()
            outputs = self.scheduler.update_from_output(so, result)
            t3 = time.perf_counter()
            times.schedule_s += t1 - t0
            times.add_launch(t2 - t1, _mixed(so))
            times.update_s += t3 - t2
            return self._after_step(outputs, t3)
        previous, self._in_flight = self._in_flight, None
        if self.scheduler.has_unfinished_requests():
            so = self._schedule()
            t1 = time.perf_counter()
            self._in_flight = (so, self.executor.execute_async(so))
            t2 = time.perf_counter()
            times.schedule_s += t1 - t0
            times.add_launch(t2 - t1, _mixed(so))
            t0 = t2
        if previous is None:
            return []
        so, pending = previous
        result = pending.result()
        t1 = time.perf_counter()
        outputs = self.scheduler.update_from_output(so, result)
        t2 = time.perf_counter()
        times.wait_s += t1 - t0
        times.update_s += t2 - t1
        return self._after_step(outputs, t2)

    def _after_step(self, outputs: list[RequestOutput], t0: float) -> list[RequestOutput]:
        outputs = self.output_processor.process(outputs)
        if self.kv_events is not None:
            self.kv_events.drain(self.scheduler.requests.values())
        self._step_times.outputs_s += time.perf_counter() - t0
        return outputs

    def step_times(self) -> StepTimes:
        """Host seconds of the steps so far, by phase (`outputs.StepTimes`); a copy."""
        return msgspec.structs.replace(self._step_times)

    def is_finished(self, request_id: str) -> bool:
        """True once the request has ended (or is unknown to the engine)."""
        req = self.scheduler.requests.get(request_id)
        return req is None or req.is_finished

    def pop_result(self, request_id: str) -> RequestResult:
        """The result of a finished request (which the engine then forgets)."""
        req = self.scheduler.pop_request(request_id)
        self.structured.remove(request_id)
        return self.output_processor.result(req)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        *,
        cache_salts: Sequence[str | None] | None = None,
    ) -> list[RequestResult]:
        """Run prompts (token id lists) to completion in one batch; results in input order."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        salts = list(cache_salts) if cache_salts is not None else [None] * len(prompts)
        ids = [self.add_request(p, sp, cache_salt=salt) for p, sp, salt in zip(prompts, params, salts)]
        while self.has_unfinished_requests():
            self.step()
        return [self.pop_result(i) for i in ids]

    def stats(self) -> EngineStats:
        """The totals and gauges as of now: a copy, so two calls can be subtracted."""
        return msgspec.structs.replace(
            self.scheduler.stats,
            num_free_blocks=self.scheduler.pool.num_free_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            cpu_tier=self.scheduler.connector.cpu_tier_usage() if self.scheduler.connector is not None else None,
        )

    def flush_connector(self) -> None:
        """Wait until the connector's background stores (disk writes, remote PUTs) have landed,
        and tell the scheduler half what finished (so the tier slots they held are free now, not
        after the next step)."""
        half = self.scheduler.connector
        if half is None:
            return
        # While a step is in flight, its own result reports what finished.
        completions = self.executor.flush_connector(take_completions=self._in_flight is None)
        if completions is not None:
            half.update_connector_output(KVConnectorOutput(completions=completions))

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_external: bool = False) -> bool:
        """vLLM's reset of the prefix cache (`POST /reset_prefix_cache`), between steps.

        Forgets every cached block of the device cache; with `reset_external`, also what the
        connector's own host tier holds (`SchedulerHalf.reset_cache`; a disk tier and remote stores
        are never wiped). Returns False while something is still held: blocks in use by requests
        (unless `reset_running_requests` first preempts every running request, which is then
        computed again) or a connector transfer in flight; nothing of the device cache is
        forgotten then, and the caller may retry after a step. An idle engine first waits for
        its connector's last stores, so that a reset between runs succeeds.
        """
        if reset_running_requests:
            self.scheduler.preempt_running()
        ok = self.scheduler.pool.reset_prefix_cache()
        if reset_external and self.scheduler.connector is not None:
            if not self.has_unfinished_requests():
                self.flush_connector()  # an idle engine's last stores land and unpin their slots now
            ok = self.scheduler.connector.reset_cache() and ok
        if self.kv_events is not None:
            self.kv_events.drain(self.scheduler.requests.values())
        return ok

    def check_integrity(self) -> None:
        """Invariants that must hold when the engine is idle (used by tests)."""
        self.scheduler.check_integrity()
        if not self.has_unfinished_requests():
            # Finished ids reach the runner with the next step's message; nothing else may linger.
            stale = set(self.executor.request_ids) - set(self.scheduler.finished_req_ids)
            if stale:
                raise AssertionError(f"the runner still holds finished request(s) {sorted(stale)}")

    def close(self) -> None:
        """Wait for pending KV stores and release connector resources."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._in_flight is not None:  # let the device finish the step it runs
                pending, self._in_flight = self._in_flight[1], None
                if self.executor.failure is None:  # a broken rank group runs nothing
                    pending.result()
            if self.kv_events is not None:
                self.kv_events.drain(self.scheduler.requests.values())
                self.kv_events.close()
        finally:
            # The worker halves write their pending stores as they stop; a broken group is killed.
            self.executor.close()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def version(self) -> str:
        return __version__


def _mixed(so) -> bool:
    """Whether a step computes more than one token of some request (not a decode step)."""
    return any(len(s.token_ids) > 1 for s in so.scheduled)
