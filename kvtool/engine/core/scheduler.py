"""Continuous batching: which requests run this step, how many tokens each, what to load or store.

There is no prefill or decode phase: each step gives every running request the tokens between
its num_computed_tokens and num_tokens (capped by the token budget), then admits waiting
requests: local prefix-cache hit first, then the connector's external hit, then blocks for the
rest. When blocks run out, the most recently admitted running request is preempted and will be
recomputed. The scheduler never touches a tensor, and it is the only reader of
`kv_load_failure_policy`.

It holds the engine's one request registry (`requests`: every request from `add_request` until
the engine takes its result with `pop_request`, finished ones included), and, as vLLM's
scheduler does, computes the structured-output bitmasks of the step's samples while it builds
the step's message (the grammars themselves are advanced by the output processor).

What it tells the runner is a `SchedulerOutput` message: a request the runner does not know yet
(first admission, or again after a preemption) in full, every scheduled request as the tokens of
the step plus the blocks added to its table since the last message. Nothing in it is shared with
the scheduler's own `Request` objects.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from kvtool.engine.connectors.base import SchedulerHalf
from kvtool.engine.core.block_hash_memo import BlockHashMemo
from kvtool.engine.core.block_pool import NULL_BLOCK, BlockPool
from kvtool.engine.core.hashing import extend_block_hashes
from kvtool.engine.core.kv_blocks import GroupTables
from kvtool.engine.errors import KVToolError
from kvtool.engine.core.messages import (
    KVConnectorOutput,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from kvtool.engine.core.request import Request, RequestStatus
from kvtool.engine.core.structured_output import StructuredOutputs
from kvtool.engine.kv.groups import KVCacheLayout, single_group
from kvtool.engine.outputs import EngineStats, RequestOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_prefix_caching: bool,
        none_hash: bytes,
        connector: SchedulerHalf | None = None,
        kv_load_failure_policy: str = "fail",
        structured_outputs: StructuredOutputs | None = None,
        layout: KVCacheLayout | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.none_hash = none_hash
        self.connector = connector
        self.kv_load_failure_policy = kv_load_failure_policy
        self.structured_outputs = structured_outputs
        # One block pool for every KV cache group (`kv.groups`; the scheduler reads only their
        # windows); one table per group for each request.
        layout = layout if layout is not None else single_group(1)
        self.pool = BlockPool(num_blocks, enable_prefix_caching, null_block=layout.hybrid)
        self.tables = GroupTables(self.pool, layout, block_size)
        self.frees_behind_window = layout.hybrid  # a sliding-window group frees blocks
        # Block hashes are needed for the prefix cache and for connectors' keys (None: no hashes).
        needs_block_hashes = enable_prefix_caching or connector is not None
        self.hash_memo = BlockHashMemo(block_size, none_hash) if needs_block_hashes else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Every request from add_request until pop_request, finished ones included.
        self.requests: dict[str, Request] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # request id -> how many of each group's block ids the runner was told (present while the runner knows it).
        self.num_sent_blocks: dict[str, list[int]] = {}
        self.finished_req_ids: list[str] = []
        # Requests preempted since the last schedule() by preempt_running(): the next message names them.
        self.preempted_between_steps: list[str] = []
        # Requests that ended inside schedule() (a connector failed on them): reported by the next update.
        self.failed_outputs: list[RequestOutput] = []
        # Waiting requests skipped in the last schedule() because a connector lookup was still pending.
        self.num_lookups_pending = 0
        # The next step's id (SchedulerOutput.step_id).
        self.num_steps_scheduled = 0
        # One entry per step scheduled and not yet updated (two at most under async scheduling).
        self.steps_in_flight: deque[dict[str, int]] = deque()
        # Blocks of finished requests that the connector still reads (until finished_sending).
        self.held_blocks: dict[str, list[int]] = {}
        self.stats = EngineStats(num_blocks=self.pool.num_usable_blocks)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if self.hash_memo is not None:
            req.block_hashes.extend(self.hash_memo.prompt_hashes(req.prompt_token_ids, req.cache_salt, req.prompt_ids))
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.stats.num_requests += 1

    def pop_request(self, request_id: str) -> Request:
        """Forget a request (the engine took its result); KeyError for an unknown id."""
        return self.requests.pop(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: str | int | None = None) -> None:
        """Finish a request for a reason only the engine can see (a stop string)."""
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            req.stop_reason = stop_reason
            self._finish(req, status)

    def preempt_running(self) -> None:
        """Preempt every running request between two steps (vLLM's reset_running_requests): their
        blocks are freed, and they wait to be computed again, first in, first out. The next
        schedule() tells the runner; a step already in flight for them is stale when it returns."""
        while self.running:
            req = self.running.pop()
            self._preempt(req)
            self.preempted_between_steps.append(req.request_id)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        new_requests: list[NewRequestData] = []
        preempted: list[str] = []

        # Running requests first, in admission order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_scheduled_tokens_total - req.num_computed_tokens, budget)
            if (num_new <= 0 or req.has_load_in_flight
                    or (req.num_output_placeholders and req.sampling.samples_from_history)
                    or len(req.output_token_ids) + req.num_output_placeholders >= req.max_tokens):
                # Waiting for a step in flight: its load, its last sample, or (penalties, grammars,
                # bad words, min_tokens) the host-side history its next sample depends on.
                i += 1
                continue
            need = self.tables.num_new_blocks(req.group_block_ids, req.num_computed_tokens + num_new,
                                              req.num_computed_tokens)
            while not self.pool.can_allocate(need):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.request_id in preempted:
                break
            self.tables.grow(req.group_block_ids, req.num_computed_tokens + num_new, req.num_computed_tokens)
            scheduled.append(self._make_scheduled(req, num_new, new_requests))
            budget -= num_new
            i += 1

        # Then admit waiting requests, unless this step had to preempt.
        skipped: list[Request] = []
        self.num_lookups_pending = 0
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            try:
                admitted = self._try_admit(req, budget, new_requests)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the engine
                self.waiting.popleft()
                self._fail_inside_schedule(req, e)
                continue
            if admitted is None:
                break
            if admitted is False:
                self.num_lookups_pending += 1
                skipped.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            self.running.append(req)
            scheduled.append(admitted)
            budget -= admitted.num_tokens
        self.waiting.extendleft(reversed(skipped))

        out = SchedulerOutput(
            step_id=self.num_steps_scheduled,
            new_requests=new_requests,
            scheduled=scheduled,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_between_steps + preempted,
            allowed_token_bitmasks=self._grammar_bitmasks(scheduled),
        )
        self.num_steps_scheduled += 1
        self.preempted_between_steps = []
        # Which incarnation of each request this step computes for: a preemption in between
        # makes its result stale.
        self.steps_in_flight.append({s.request_id: self.requests[s.request_id].num_preemptions for s in scheduled})
        self.finished_req_ids = []
        if self.connector is not None:
            out.connector_meta = self.connector.build_connector_meta(out)
        return out

    def _grammar_bitmasks(self, scheduled: list[ScheduledRequest]) -> dict:
        """The grammar's allowed ids for each sample of this step (a request with a grammar is
        never scheduled before its previous sample is back, so its grammar is up to date)."""
        so = self.structured_outputs
        if not so:
            return {}
        return {s.request_id: so.bitmask(s.request_id) for s in scheduled if s.sample and s.request_id in so}

    def _fail_inside_schedule(self, req: Request, error: Exception) -> None:
        """End one request whose connector calls raised while it was being admitted."""
        if isinstance(error, KVToolError):
            message = str(error)
        else:
            logger.exception("scheduling request %s failed", req.request_id)
            message = f"internal error while scheduling: {type(error).__name__}: {error}"
        req.error = message
        if req.status == RequestStatus.RUNNING and req in self.running:
            self.running.remove(req)
        req.status = RequestStatus.WAITING
        self._finish(req, RequestStatus.FINISHED_ERROR)
        self.failed_outputs.append(
            RequestOutput(request_id=req.request_id, new_token_ids=[], finished=True, finish_reason="error",
                          error=message, num_output_tokens=len(req.output_token_ids))
        )

    def _try_admit(self, req: Request, budget: int, new_requests: list[NewRequestData]) -> ScheduledRequest | bool | None:
        """Admit one waiting request: ScheduledRequest, False (skip it this step) or None (stop admitting)."""
        bs = self.block_size
        # At least one token must be computed, so a full hit leaves the last token out.
        max_hit_blocks = (req.num_tokens - 1) // bs
        hits, num_hit_blocks = self.tables.find_hit(req.block_hashes, max_hit_blocks)
        num_local = num_hit_blocks * bs
        num_ext = 0
        if self.connector is not None:
            matched, _ = self.connector.get_num_new_matched_tokens(req, num_local)
            if matched is None:
                return False
            num_ext = max(0, min(matched, req.num_tokens - 1 - num_local))
        num_computed = num_local + num_ext
        num_new = min(req.num_tokens - num_computed, budget)
        need = self.tables.num_new_blocks(hits, num_computed + num_new, num_computed)
        num_free_hits = self.tables.num_free_hits(hits)
        if not self.pool.can_allocate(need + num_free_hits):
            return None
        for t in hits:
            self.pool.touch(t)
        req.group_block_ids = hits
        self.tables.grow(hits, num_computed + num_new, num_computed)
        self.num_cached_blocks[req.request_id] = num_hit_blocks
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_local
            req.num_external_tokens = num_ext
            self.stats.num_prompt_tokens += req.num_prompt_tokens
            self.stats.num_prefix_cache_queries += req.num_prompt_tokens
            self.stats.num_prefix_cache_hits += num_local
            self.stats.external_tokens_matched += num_ext
        # The connector reads the local hit from num_computed_tokens, then the external tokens follow it.
        req.num_computed_tokens = num_local
        if self.connector is not None:
            self.connector.update_state_after_alloc(req, req.block_ids, num_ext)
        req.num_computed_tokens = num_computed
        req.has_load_in_flight = num_ext > 0
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.perf_counter()
        return self._make_scheduled(req, num_new, new_requests)

    def _make_scheduled(self, req: Request, num_new: int, new_requests: list[NewRequestData]) -> ScheduledRequest:
        """The step's message for one request; a request the runner does not know comes in full."""
        rid = req.request_id
        tables = req.group_block_ids
        sent = self.num_sent_blocks.get(rid)
        if sent is None:
            sent = [0] * len(tables)
            new_requests.append(
                NewRequestData(request_id=rid, prompt_token_ids=list(req.prompt_token_ids),
                               output_token_ids=list(req.output_token_ids), sampling=req.sampling, seed=req.seed,
                               eos_token_ids=[] if req.sampling.ignore_eos else sorted(req.eos_token_ids))
            )
        self.num_sent_blocks[rid] = [len(t) for t in tables]
        start = req.num_computed_tokens
        sample = start + num_new == req.num_scheduled_tokens_total
        req.num_computed_tokens += num_new
        if sample:
            req.num_output_placeholders += 1
        return ScheduledRequest(
            request_id=rid,
            token_ids=req.token_ids_slice(start, start + num_new),
            start=start,
            new_block_ids=tables[0][sent[0]:],
            sample=sample,
            new_group_block_ids=[t[n:] for t, n in zip(tables[1:], sent[1:])],
        )

    def _preempt(self, req: Request) -> None:
        self.tables.free(req.group_block_ids)
        req.group_block_ids = [[] for _ in req.group_block_ids]
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        req.num_output_placeholders = 0
        req.has_load_in_flight = False
        self.num_cached_blocks.pop(req.request_id, None)
        self.num_sent_blocks.pop(req.request_id, None)
        self.waiting.appendleft(req)
        self.stats.num_preemptions += 1

    # ---- results back --------------------------------------------------------------------

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[RequestOutput]:
        outputs: list[RequestOutput] = self.failed_outputs
        self.failed_outputs = []
        conn_out = runner_out.connector_output
        invalid: set[int] = set()
        if conn_out is not None:
            invalid = conn_out.invalid_block_ids
            self._apply_connector_output(conn_out)
        bs = self.block_size
        incarnations = self.steps_in_flight.popleft() if self.steps_in_flight else {}
        for s in sched_out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.is_finished or req.status != RequestStatus.RUNNING:
                continue
            if incarnations.get(s.request_id, req.num_preemptions) != req.num_preemptions:
                continue  # preempted after this step was scheduled: recomputed from scratch
            req.has_load_in_flight = False
            if s.sample:
                req.num_output_placeholders -= 1
            first_bad = self._first_invalid_block(req, invalid) if invalid else None
            if first_bad is not None:
                out = self._handle_invalid_blocks(req, first_bad, conn_out)
                if out is not None:
                    outputs.append(out)
                continue
            self._cache_full_blocks(req, s.start + s.num_tokens)
            if self.frees_behind_window:
                self.tables.free_skipped(req.group_block_ids, s.start + s.num_tokens)
            if not s.sample:
                continue
            token = runner_out.sampled[req.request_id]
            req.output_token_ids.append(token)
            lp = runner_out.logprobs.get(s.request_id)
            if lp is not None:
                req.logprobs.append(lp)
            self.stats.num_generation_tokens += 1
            if self.hash_memo is not None and req.num_tokens % bs == 0:
                extend_block_hashes(req.block_hashes, req.all_token_ids, bs, self.none_hash, req.cache_salt)
            status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status)
            outputs.append(self._output(req, [token], [lp] if lp is not None else None))
        return outputs

    def _output(self, req: Request, new_token_ids: list[int], new_logprobs: list | None) -> RequestOutput:
        finished = req.is_finished
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason if finished else None,
            error=req.error,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=req.num_cached_tokens or 0,
            num_external_tokens=req.num_external_tokens,
            kv_transfer_params=(req.kv_transfer_params or None) if finished else None,
        )

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling
        if not sp.ignore_eos and token in req.eos_token_ids:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token in sp.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _cache_full_blocks(self, req: Request, num_computed: int) -> None:
        """Register the request's blocks that are full up to `num_computed` (a step's result is in)."""
        done = self.num_cached_blocks.get(req.request_id, 0)
        full = min(num_computed // self.block_size, len(req.block_hashes))
        if full > done:
            self.tables.cache(req.group_block_ids, req.block_hashes, done, full)
            self.num_cached_blocks[req.request_id] = full

    @staticmethod
    def _first_invalid_block(req: Request, invalid: set[int]) -> int | None:
        """The first table entry, over every group, whose block failed to load (None: none did).
        A load never fills the null block, so it is never among them."""
        firsts = [next((i for i, b in enumerate(t) if b in invalid), None) for t in req.group_block_ids]
        return min((i for i in firsts if i is not None), default=None)

    def _handle_invalid_blocks(
        self, req: Request, first: int, conn_out: KVConnectorOutput | None
    ) -> RequestOutput | None:
        """Apply kv_load_failure_policy to a request whose external KV failed to load this step.

        The step's forward ran over those blocks; its sampled token is discarded either way.
        fail: the request ends with an error, and the bad block and every later block of the
        request leave the prefix cache. recompute: num_computed_tokens goes back to the first
        bad block, and the rest is computed again; where a sliding-window group holds the null
        block among the entries a recompute from there would read (its window before the first bad
        block) or write, the request starts over as after a preemption instead (the tier's keys
        that failed are not matched again, so it recomputes what they held).
        """
        self.stats.load_failures += 1
        for t in req.group_block_ids:
            self.pool.evict(t[first:])
        if self.kv_load_failure_policy == "fail":
            reasons = conn_out.invalid_reasons if conn_out is not None else {}
            bad = (b for t in req.group_block_ids for b in t[first:first + 1] if b in reasons)
            reason = reasons.get(next(bad, None), "external KV failed to load")
            req.error = f"KV load failed for request {req.request_id}: {reason}"
            self._finish(req, RequestStatus.FINISHED_ERROR)
            return self._output(req, [], None)
        recomputed_from = first * self.block_size
        if req.num_cached_tokens is not None:
            req.num_external_tokens = max(0, min(req.num_external_tokens, recomputed_from - req.num_cached_tokens))
        if self.pool.has_null_block and any(
                NULL_BLOCK in t[first if w is None else max(0, recomputed_from - w + 1) // self.block_size:]
                for t, w in zip(req.group_block_ids, self.tables.windows)):
            self.running.remove(req)
            self._preempt(req)
            return None
        req.num_computed_tokens = min(req.num_computed_tokens, recomputed_from)
        self.num_cached_blocks[req.request_id] = min(self.num_cached_blocks.get(req.request_id, 0), first)
        return None

    def _apply_connector_output(self, out: KVConnectorOutput) -> None:
        st = out.stats
        self.stats.bytes_loaded += st.bytes_loaded
        self.stats.bytes_stored += st.bytes_stored
        self.stats.load_s += st.load_s
        self.stats.store_s += st.store_s
        self.stats.store_skipped_chunks += st.store_skipped_chunks
        for rid, n in st.tokens_loaded.items():
            self.stats.external_tokens_loaded += n
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                req.num_external_loaded_tokens += n
        for rid, n in st.tokens_loaded_from_disk.items():
            self.stats.external_tokens_loaded_from_disk += n
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                req.num_external_loaded_from_disk += n
        for rid, n in st.tokens_stored.items():
            self.stats.external_tokens_stored += n
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                req.num_external_stored_tokens += n
        if self.connector is not None:
            self.connector.update_connector_output(out)
        for rid in out.finished_sending:
            blocks = self.held_blocks.pop(rid, None)
            if blocks is not None:
                self.pool.free(blocks)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        was_running = req.status == RequestStatus.RUNNING
        req.status = status
        self.stats.num_finished += 1
        if was_running:
            self.running.remove(req)
        keep = False
        if self.connector is not None:
            keep, params = self.connector.request_finished(req, req.block_ids)
            if params:
                req.kv_transfer_params = {**req.kv_transfer_params, **params}
        if keep:
            self.held_blocks[req.request_id] = [b for t in req.group_block_ids for b in t]
        else:
            self.tables.free(req.group_block_ids)
        req.group_block_ids = [[] for _ in req.group_block_ids]
        self.num_cached_blocks.pop(req.request_id, None)
        if self.num_sent_blocks.pop(req.request_id, None) is not None:
            self.finished_req_ids.append(req.request_id)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
