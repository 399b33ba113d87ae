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
from kvtool.engine.connectors.base import ConnectorContext, EngineIdentity, SchedulerHalf, WorkerHalf

__all__ = ["DEFAULT_MODEL_NAME", "LLMEngine", "identity_for_model", "resolve_device", "resolve_dtype", "resolve_model_path"]
from kvtool.engine.connectors.registry import refuse_unrunnable_connector, resolve_connector
from kvtool.engine.default_model import DEFAULT_MODEL_NAME, resolve_model_path
from kvtool.engine.errors import ConfigError, InputError
from kvtool.engine.hashing import make_none_hash, uint32_ids
from kvtool.engine.identity import engine_identity, identity_for_model, rank_identity, resolve_device, resolve_dtype
from kvtool.engine.kv_pages import DTYPE_NAMES, KVGeometry, KVPages
from kvtool.engine.messages import KVConnectorOutput
from kvtool.engine.outputs import EngineStats, RequestOutput, RequestResult, RequestStats
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.engine.request import Request, RequestStatus
from kvtool.engine.runner import ModelRunner
from kvtool.engine.scheduler import Scheduler
from kvtool.engine.structured_output import StructuredOutputs
from kvtool.engine.tp_executor import TPExecutor, start_tp_executor
from kvtool.engine.tp_layout import TPRank, check_tp_fits, kv_head_range


Progress = Callable[[str, float], None]

# How long step() waits when every waiting request waits for an asynchronous connector lookup.
LOOKUP_POLL_S = 0.001


def token_id_list(ids: Sequence[int]) -> tuple[list[int], int, int, np.ndarray | None]:
    """(the prompt as a list of Python ints, its smallest id, its largest, the same ids as one
    uint32 array or None). A list or tuple of integers of any kind (int, bool, NumPy's) goes
    through one C array (uint32 for a real vocabulary's ids, else int64), which also gives min
    and max in C: about half the time of int() on every id of a long prompt. Anything else (a
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
        from kvtool.engine.model_dir import open_model_dir
        from kvtool.engine.models import build_model

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
        tp_size = params.tensor_parallel_size
        check_tp_fits(cfg.num_heads, cfg.num_kv_heads, tp_size)
        if tp_size > 1 and self.device.type == "cuda" and torch.cuda.device_count() < tp_size:
            raise ConfigError(
                f"--tensor-parallel-size {tp_size} needs {tp_size} CUDA devices, found {torch.cuda.device_count()}"
            )
        # TP > 1: the model, its KV pages and the connector's worker half live in the worker
        # processes (tp_executor.py); this process keeps the scheduler and the scheduler half.
        self.tp_executor: TPExecutor | None = None
        self.none_hash = make_none_hash()
        self.identity: EngineIdentity | None = None
        if connector_cls is not None:
            self.identity = engine_identity(params, self.model_dir, self.dtype, self.device.type)
        if tp_size == 1:
            torch.manual_seed(params.seed)
            self.model = build_model(self.model_dir, self.device, self.dtype, params.load_format, params.seed)
        else:
            self.model = None
            self.tp_executor = start_tp_executor(params, self.model_dir.path, self.device, self.dtype,
                                                 self.max_model_len, self.identity, self.none_hash)
        try:
            scheduler_half, worker_half = self._init_cache_and_connector(connector_cls)
            self._open_kv_events(scheduler_half)
        except BaseException:
            if self.tp_executor is not None:
                self.tp_executor.close()
            raise
        self.worker_connector = worker_half
        self.scheduler_connector = scheduler_half
        self.async_scheduling = (
            params.async_scheduling if params.async_scheduling is not None else self.device.type == "cuda"
        )
        # Under async scheduling: the step the device is running (its message and its pending result).
        self._in_flight = None
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        # Seeds for requests that bring none: reproducible from --seed, independent of batching.
        self._seeds = torch.Generator().manual_seed(params.seed)
        self.structured = StructuredOutputs(self.tokenizer.backend.to_str, cfg.vocab_size, list(cfg.eos_token_ids))
        self._closed = False

    def _open_kv_events(self, scheduler_half: SchedulerHalf | None) -> None:
        """KV events (kv_events.py): the block pool records, step() publishes one batch."""
        params = self.params
        self.kv_events = None
        if params.kv_events_config is not None:
            # pyzmq is loaded only by an engine that publishes.
            from kvtool.engine.kv_event_publisher import open_kv_event_stream

            self.kv_events = open_kv_event_stream(params.kv_events_config, params.block_size)
        if self.kv_events is not None:
            self.kv_events.attach(self.scheduler.pool)
            recorder = scheduler_half.kv_event_recorder() if scheduler_half is not None else None
            if recorder is not None:
                self.kv_events.recorders.append(recorder)

    def _init_cache_and_connector(self, connector_cls) -> tuple[SchedulerHalf | None, WorkerHalf | None]:
        """The KV pages (here, or in every rank), the scheduler, the runner and the connector's halves."""
        params, cfg, ktc = self.params, self.model_config, self.params.kv_transfer_config
        tp = TPRank(params.tensor_parallel_size, 0)
        geometry = KVGeometry(
            num_layers=cfg.num_layers,
            num_kv_heads=kv_head_range(cfg.num_kv_heads, tp)[1],
            head_dim=cfg.head_dim,
            block_size=params.block_size,
            dtype=DTYPE_NAMES[self.dtype],
        )
        if self.tp_executor is None:
            self.num_blocks = self._num_blocks(geometry)
            self.kv_pages = KVPages(geometry, self.num_blocks, self.device)
        else:
            # Rank 0 holds the most KV heads; every rank gets as many blocks as the tightest can hold.
            self.num_blocks = min(self._num_blocks(geometry, info) for info in self.tp_executor.memory_info)
            self.kv_pages = None
            self.tp_executor.init_cache(self.num_blocks)

        scheduler_half: SchedulerHalf | None = None
        worker_half: WorkerHalf | None = None
        if connector_cls is not None:
            identity = self.identity if self.tp_executor is None else rank_identity(self.identity, tp)
            ctx = ConnectorContext(config=ktc, identity=identity, none_hash=self.none_hash)
            # Each half is built on its own: they share nothing but the config and the store.
            scheduler_half = connector_cls.create_scheduler_half(ctx)
            try:
                if self.tp_executor is None:
                    worker_half = connector_cls.create_worker_half(ctx)
            except BaseException:
                scheduler_half.shutdown()
                raise

        self.scheduler = Scheduler(
            num_blocks=self.num_blocks,
            block_size=params.block_size,
            max_num_batched_tokens=params.max_num_batched_tokens,
            max_num_seqs=params.max_num_seqs,
            enable_prefix_caching=params.enable_prefix_caching,
            none_hash=self.none_hash,
            connector=scheduler_half,
            kv_load_failure_policy=ktc.kv_load_failure_policy if ktc else "fail",
        )
        if self.tp_executor is None:
            self.runner = ModelRunner(
                self.model, self.kv_pages, self.device, worker_half, max_model_len=self.max_model_len,
                use_cuda_graphs=not params.enforce_eager, backend=params.attention_backend,
                batch_invariant=params.batch_invariant, max_num_seqs=params.max_num_seqs,
            )
        else:
            self.runner = self.tp_executor
        return scheduler_half, worker_half

    def _num_blocks(self, geometry: KVGeometry, free_total: tuple[int, int] | None = None) -> int:
        """KV blocks that fit; free_total: a worker's (free, total) device bytes (else this process's)."""
        p = self.params
        if p.num_gpu_blocks is not None:
            return p.num_gpu_blocks
        if self.device.type == "cuda":
            free, total = free_total if free_total is not None else torch.cuda.mem_get_info(self.device)
            budget = free - (1.0 - p.gpu_memory_utilization) * total
            n = int(budget // geometry.bytes_per_block)
        else:
            n = p.kv_cache_memory // geometry.bytes_per_block
        # More blocks than any set of max_num_seqs full-length requests can use is waste.
        cap = p.max_num_seqs * -(-self.max_model_len // geometry.block_size) + 1
        n = min(n, cap)
        if n < 1:
            raise ConfigError(
                f"no room for KV blocks ({geometry.bytes_per_block} bytes each); "
                "raise --kv-cache-memory / --gpu-memory-utilization or set --num-gpu-blocks"
            )
        return n

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
        blocks = -(-(n + max_tokens) // self.params.block_size)
        if blocks > self.num_blocks:
            raise InputError(
                f"the request needs {blocks} KV blocks ({n} prompt + {max_tokens} output tokens) but the "
                f"KV cache holds {self.num_blocks}; raise --kv-cache-memory or --num-gpu-blocks, "
                "or lower max_tokens"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
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
        if self.scheduler_connector is not None:
            self.scheduler_connector.check_request(req)
        if sampling.structured_outputs is not None:
            self.structured.add(rid, sampling.structured_outputs)
        self._requests[rid] = req
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
        if self.structured:
            # The grammar's allowed ids for each sample of this step (the engine owns the grammars;
            # a request with one is never scheduled before its previous sample is back).
            so.allowed_token_bitmasks = {
                s.request_id: self.structured.bitmask(s.request_id)
                for s in so.scheduled if s.sample and s.request_id in self.structured
            }
        return so

    def step(self) -> list[RequestOutput]:
        """Run one engine step. Returns what changed for each request that produced a token or ended.

        Under async scheduling the step schedules and queues the next batch first, then waits for
        the batch already on the device and reports it: the host schedules while the device computes.
        """
        if not self.async_scheduling:
            so = self._schedule()
            outputs = self.scheduler.update_from_output(so, self.runner.execute(so))
            return self._after_step(outputs)
        previous, self._in_flight = self._in_flight, None
        if self.scheduler.has_unfinished_requests():
            so = self._schedule()
            self._in_flight = (so, self.runner.execute_async(so))
        if previous is None:
            return []
        so, pending = previous
        return self._after_step(self.scheduler.update_from_output(so, pending.result()))

    def _after_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        if self.structured:
            for out in outputs:
                if out.request_id in self.structured:
                    self.structured.advance(out.request_id, out.new_token_ids)
        now = time.perf_counter()
        for out in outputs:
            req = self._requests[out.request_id]
            if out.new_token_ids and req.first_token_time is None:
                req.first_token_time = now
            if not req.is_finished and req.sampling.stop and self._hit_stop_string(req):
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, req.stop_reason)
                out.finished = True
                out.finish_reason = "stop"
                out.stop_reason = req.stop_reason
                out.kv_transfer_params = req.kv_transfer_params or None
            if req.is_finished and req.finish_time is None:
                req.finish_time = now
        if self.kv_events is not None:
            self.kv_events.drain(self._requests.values())
        return outputs

    def is_finished(self, request_id: str) -> bool:
        """True once the request has ended (or is unknown to the engine)."""
        req = self._requests.get(request_id)
        return req is None or req.is_finished

    def _hit_stop_string(self, req: Request) -> bool:
        # A stop string ends in the newest tokens: decode a tail long enough to hold the longest
        # one (a token is at least one byte, a character at most four), not the whole output.
        window = 4 * max(len(s) for s in req.sampling.stop) + 1
        text = self.tokenizer.decode(req.output_token_ids[-window:])
        for stop in req.sampling.stop:
            if stop and stop in text:
                req.stop_reason = stop
                return True
        return False

    def output_text(self, req: Request) -> str:
        text = self.tokenizer.decode(req.output_token_ids)
        if isinstance(req.stop_reason, str) and req.stop_reason in text:
            text = text[: text.index(req.stop_reason)]
        return text

    def pop_result(self, request_id: str) -> RequestResult:
        """The result of a finished request (which the engine then forgets)."""
        req = self._requests.pop(request_id)
        self.structured.remove(request_id)
        return self._result(req)

    def _result(self, req: Request) -> RequestResult:
        ttft = req.first_token_time - req.arrival_time if req.first_token_time else None
        decode = req.finish_time - req.first_token_time if req.finish_time and req.first_token_time else None
        scheduled = req.first_scheduled_time
        queue_s = scheduled - req.arrival_time if scheduled is not None else None
        prefill_s = req.first_token_time - scheduled if scheduled is not None and req.first_token_time else None
        return RequestResult(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            text=self.output_text(req),
            finish_reason=req.status.value if req.is_finished else "running",
            error=req.error,
            logprobs=req.logprobs or None,
            stop_reason=req.stop_reason,
            kv_transfer_params=req.kv_transfer_params or None,
            stats=RequestStats(
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens or 0,
                num_external_tokens=req.num_external_tokens,
                num_external_loaded_tokens=req.num_external_loaded_tokens,
                num_external_stored_tokens=req.num_external_stored_tokens,
                num_preemptions=req.num_preemptions,
                ttft_s=ttft,
                decode_s=decode,
                queue_s=queue_s,
                prefill_s=prefill_s,
            ),
        )

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
            cpu_tier=self.scheduler_connector.cpu_tier_usage() if self.scheduler_connector is not None else None,
        )

    def flush_connector(self) -> None:
        """Wait until the connector's background stores (disk writes, remote PUTs) have landed,
        and tell the scheduler half what finished (so the tier slots they held are free now, not
        after the next step)."""
        if self.tp_executor is not None and self.scheduler_connector is not None:
            completions = self.tp_executor.flush_connector(take_completions=self._in_flight is None)
            if completions is not None:
                self.scheduler_connector.update_connector_output(KVConnectorOutput(completions=completions))
            return
        if self.worker_connector is None:
            return
        self.worker_connector.flush()
        if self._in_flight is not None or self.scheduler_connector is None:
            return  # the step in flight reports them
        completions = self.worker_connector.take_completions()
        if completions is not None:
            self.scheduler_connector.update_connector_output(KVConnectorOutput(completions=completions))

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
        if reset_external and self.scheduler_connector is not None:
            if not self.has_unfinished_requests():
                self.flush_connector()  # an idle engine's last stores land and unpin their slots now
            ok = self.scheduler_connector.reset_cache() and ok
        if self.kv_events is not None:
            self.kv_events.drain(self._requests.values())
        return ok

    def check_integrity(self) -> None:
        """Invariants that must hold when the engine is idle (used by tests)."""
        self.scheduler.check_integrity()
        if not self.has_unfinished_requests():
            # Finished ids reach the runner with the next step's message; nothing else may linger.
            stale = set(self.runner.request_ids) - set(self.scheduler.finished_req_ids)
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
                if self.tp_executor is None or self.tp_executor.failure is None:  # a broken group runs nothing
                    pending.result()
            if self.kv_events is not None:
                self.kv_events.drain(self._requests.values())
                self.kv_events.close()
            if self.worker_connector is not None:
                self.worker_connector.shutdown()
        finally:
            # The workers' halves write their pending stores as they stop; a broken group is killed.
            if self.tp_executor is not None:
                self.tp_executor.close()
        if self.scheduler_connector is not None:
            self.scheduler_connector.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def version(self) -> str:
        return __version__
