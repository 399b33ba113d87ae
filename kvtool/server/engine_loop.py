"""The engine loop: one thread steps the engine for every HTTP request at once.

HTTP handlers never touch the engine. They put commands (add, abort, stop) on a thread-safe
queue; the loop drains it before each step, so requests from different connections are
batched together (continuous batching). Each request's events go back to an EventSink: an
asyncio queue filled through `loop.call_soon_threadsafe`, so the event loop is never blocked by
a step and the engine is only ever used by the loop thread.

    HTTP handler ──add/abort──> commands queue ──> loop thread: drain, engine.step(), dispatch
         ^                                                                          │
         └────────────── EventSink (asyncio.Queue) <── call_soon_threadsafe ────────┘

Events of one request, in order: Accepted or Rejected; then Tokens (streaming requests only,
one per step that produced tokens); then Finished. Failed takes the place of Accepted or of
Finished when the loop cannot run the request: it is shutting down, or the engine raised.

One request's failure never stops the loop. add_request raising InputError (or any KVToolError)
rejects that request (400); any other exception while adding it fails it alone (500). A step that
raises fails the requests added since the last good step (a bad request fails at its first
schedule), or every request in flight when none was, aborting each in the engine so its blocks
are freed, and the loop goes on. Only a failure of the engine itself (a device error, memory
exhausted, or steps that keep failing) stops the loop; /health then answers 503.

Shutdown: drain(grace_s) refuses new requests and aborts those still running grace_s seconds
later (they end with Finished, finish_reason "abort", so streams close properly); shutdown()
aborts whatever is left, calls engine.close() (which waits for pending KV stores) on the loop
thread, and joins it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from kvtool.engine.errors import KVToolError, WorkerError
from kvtool.engine.outputs import EngineStats, RequestOutput, RequestResult
from kvtool.engine.params import SamplingParams

if TYPE_CHECKING:
    from kvtool.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

# Steps failing in a row after which the engine itself is taken as broken.
MAX_CONSECUTIVE_STEP_FAILURES = 3


def is_engine_failure(e: BaseException) -> bool:
    """Whether an exception means the engine itself is broken (device lost, memory exhausted),
    as opposed to one request's fault."""
    if isinstance(e, (MemoryError, SystemError, WorkerError)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    text = f"{type(e).__name__}: {e}"
    return "CUDA" in text or "cuda" in text or "OutOfMemoryError" in text


@dataclass(slots=True)
class GenerationJob:
    """One request for the engine, already tokenized and validated by the HTTP side."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    # True: a Tokens event per step; False: only the Finished event.
    stream: bool = False
    # Another request of the same prompt (choice 0 of n): this one enters the engine once that one
    # has its first token, so that its prompt blocks are computed once and then shared through
    # the prefix cache instead of computed by every choice in the same step.
    share_prefix_with: str | None = None


# ---- events (loop thread -> HTTP side) ---------------------------------------------------------


@dataclass(slots=True)
class Accepted:
    """The engine queued the request."""


@dataclass(slots=True)
class Rejected:
    """The engine refused the request (an InputError: too long, bad token ids, ...)."""

    error: KVToolError


@dataclass(slots=True)
class Tokens:
    """New output tokens of a streaming request (never the last ones: those come with Finished)."""

    token_ids: list[int]
    # One {token id: logprob} per token when the request asked for logprobs.
    logprobs: list[dict[int, float]] | None


@dataclass(slots=True)
class Finished:
    """The request ended; `result` holds every output token, the final text and the stats."""

    result: RequestResult
    stop_reason: str | int | None
    kv_transfer_params: dict | None


@dataclass(slots=True)
class Failed:
    """The loop could not run the request to an end."""

    message: str
    # True: the server is shutting down (try again elsewhere); False: the engine failed.
    is_shutdown: bool


Event = Accepted | Rejected | Tokens | Finished | Failed


class EventSink:
    """The asyncio end of one request's events. Create it on the event loop thread."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, event: object) -> None:
        """Thread-safe; a no-op once the event loop has closed (nobody is listening then)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def put_nowait(self, event: object) -> None:
        """From the event loop thread itself (e.g. a disconnect watcher)."""
        self._queue.put_nowait(event)

    async def get(self) -> object:
        return await self._queue.get()


# ---- commands (HTTP side -> loop thread) -------------------------------------------------------


@dataclass(slots=True)
class _Add:
    job: GenerationJob
    sink: EventSink


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Drain:
    deadline: float  # time.monotonic() after which requests still in flight are aborted


@dataclass(slots=True)
class _Stop:
    pass


@dataclass(slots=True)
class _ResetPrefixCache:
    reset_running_requests: bool
    reset_external: bool
    done: concurrent.futures.Future  # the engine's answer (bool), or its exception


@dataclass(slots=True)
class _Tracked:
    job: GenerationJob
    sink: EventSink
    num_sent_tokens: int = 0
    has_output: bool = False
    last_token_ts: float = 0.0  # time.monotonic() of the step that gave its latest tokens


class EngineLoop:
    """Owns an LLMEngine from start() on: only the loop thread calls it, and it closes it at the end.

    on_finished(result) is called on the loop thread for every request that ends (metrics).
    on_token_gap(seconds) is called on the loop thread for every step that gave a request tokens
    after its first ones, with the time since its previous such step: vLLM's inter-token latency,
    one observation per engine output, not per request.
    """

    def __init__(self, engine: LLMEngine, on_finished: Callable[[RequestResult], None] | None = None,
                 on_token_gap: Callable[[float], None] | None = None) -> None:
        self._engine = engine
        self.on_finished = on_finished
        self.on_token_gap = on_token_gap
        # Called on the loop thread with the exception once the engine failed and every request ended.
        self.on_engine_failed: Callable[[BaseException], None] | None = None
        self._failure: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._parked: dict[str, list[_Add]] = {}  # loop thread: leader request id -> jobs waiting for its first token
        self._lock = threading.Lock()  # guards _accepting against add() racing the loop's exit
        self._accepting = False
        self._draining = False
        self._deadline: float | None = None  # loop thread only
        self._thread: threading.Thread | None = None
        self._stats = msgspec.structs.replace(engine.stats())
        self._queues = (0, 0)  # (running, waiting) as of the end of the last step
        self.error: str | None = None
        self._fresh: list[str] = []  # loop thread: requests added since the last good step
        self._step_failures = 0
        # Read-only facts the HTTP side needs (copied, so it never reads the engine).
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size

    # ---- HTTP side ----------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._accepting = True
            self._thread = threading.Thread(target=self._run, name="kvtool-engine-loop", daemon=True)
            self._thread.start()

    def add(self, job: GenerationJob, sink: EventSink) -> None:
        """Queue a request. Its events arrive on `sink`: Accepted or Rejected first, or Failed."""
        with self._lock:
            if self._accepting and not self._draining:
                self._commands.put(_Add(job, sink))
                return
        sink.put(self._failed())

    def abort(self, request_id: str) -> None:
        """Abort a request (its client went away); unknown or finished ids are ignored."""
        self._commands.put(_Abort(request_id))

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> bool:
        """The engine's reset_prefix_cache, run on the loop thread between two steps; its answer.

        Raises KVToolError when the loop is not running (shutting down, or the engine failed)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            accepting = self._accepting and not self._draining
            if accepting:
                self._commands.put(_ResetPrefixCache(reset_running_requests, reset_external, done))
        if not accepting:
            raise KVToolError(self._failed().message)
        return await asyncio.wrap_future(done)

    def stats(self) -> EngineStats:
        """The engine's totals as of the end of the last step (a copy; safe from any thread)."""
        return self._stats

    def queue_counts(self) -> tuple[int, int]:
        """(running, waiting) requests as of the end of the last step (safe from any thread)."""
        return self._queues

    @property
    def is_running(self) -> bool:
        return self._accepting and not self._draining and self.error is None

    def drain(self, grace_s: float) -> None:
        """Begin a graceful shutdown: refuse new requests now (their sinks get Failed), let those in
        flight run for up to grace_s seconds, then abort the rest (Finished, finish_reason "abort")."""
        with self._lock:
            if self._draining:
                return
            self._draining = True
        self._commands.put(_Drain(time.monotonic() + grace_s))

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop: requests still in flight are aborted (their sinks get Finished with
        finish_reason "abort"), then engine.close() waits for pending KV stores. Idempotent."""
        thread = self._thread
        if thread is None:
            return
        self._commands.put(_Stop())
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the engine loop did not stop within %.1f s", timeout)

    # ---- loop thread --------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self._engine
        try:
            while self._drain(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    self._step()
                if not engine.has_unfinished_requests() and self._tracked:
                    self._finish_stragglers()
                if self._deadline is not None and self._tracked and time.monotonic() >= self._deadline:
                    logger.info("aborting %d request(s) still running at shutdown", len(self._tracked))
                    for request_id in list(self._tracked):
                        self._abort(request_id)
                self._stats = msgspec.structs.replace(engine.stats())
                self._queues = (self._stats.num_running, self._stats.num_waiting)
        except Exception as e:  # noqa: BLE001 - the loop must report, not vanish
            self._failure = e
            if isinstance(e, KVToolError):  # a failure the engine names itself: one line
                logger.error("the engine failed: %s; refusing new requests", e)
                self.error = f"the engine failed: {e}"
            else:
                logger.exception("the engine loop failed; refusing new requests")
                self.error = f"the engine failed: {type(e).__name__}: {e}"

        finally:
            with self._lock:
                self._accepting = False
            self._end_all()
            if self._failure is not None and self.on_engine_failed is not None:
                self.on_engine_failed(self._failure)

    def _step(self) -> None:
        """One engine step; a failure that belongs to requests ends them, not the loop."""
        try:
            outputs = self._engine.step()
        except Exception as e:  # noqa: BLE001 - classified below
            self._step_failures += 1
            if is_engine_failure(e) or self._step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            suspects = self._fresh or list(self._tracked)
            logger.warning("a step failed (%s: %s); failing %d request(s)", type(e).__name__, e, len(suspects))
            self._fresh = []
            for request_id in suspects:
                self._fail_request(request_id, f"the request failed: {type(e).__name__}: {e}")
            return
        self._step_failures = 0
        self._fresh = []
        self._dispatch(outputs)

    def _fail_request(self, request_id: str, message: str) -> None:
        """End one request with a 500 (Failed) and free what the engine holds for it."""
        t = self._tracked.pop(request_id, None)
        try:
            self._engine.abort_request(request_id)
            self._engine.pop_result(request_id)
        except Exception:  # noqa: BLE001 - the request is gone either way
            logger.exception("cleaning up failed request %s", request_id)
        if t is not None:
            t.sink.put(Failed(message, is_shutdown=False))
        self._release(request_id)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; wait for one first when `block`. False once a stop arrives."""
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            elif isinstance(cmd, _ResetPrefixCache):
                self._reset_prefix_cache(cmd)
            else:
                self._deadline = cmd.deadline
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _reset_prefix_cache(self, cmd: _ResetPrefixCache) -> None:
        try:
            cmd.done.set_result(self._engine.reset_prefix_cache(cmd.reset_running_requests, cmd.reset_external))
        except Exception as e:  # noqa: BLE001 - the caller gets it; only an engine failure stops the loop
            cmd.done.set_exception(e)
            if is_engine_failure(e):
                raise
            logger.exception("resetting the prefix cache failed")

    def _add(self, cmd: _Add) -> None:
        job = cmd.job
        leader = self._tracked.get(job.share_prefix_with) if job.share_prefix_with is not None else None
        if leader is not None and not leader.has_output:
            self._parked.setdefault(job.share_prefix_with, []).append(cmd)
            return
        try:
            self._engine.add_request(
                job.prompt_token_ids,
                job.sampling,
                request_id=job.request_id,
                cache_salt=job.cache_salt,
                kv_transfer_params=job.kv_transfer_params,
            )
        except KVToolError as e:
            cmd.sink.put(Rejected(e))
            return
        except Exception as e:  # noqa: BLE001 - one request's fault must not stop the loop
            if is_engine_failure(e):
                raise
            logger.warning("adding request %s failed: %s: %s", job.request_id, type(e).__name__, e)
            with contextlib.suppress(Exception):
                self._engine.abort_request(job.request_id)
                self._engine.pop_result(job.request_id)
            cmd.sink.put(Failed(f"the request failed: {type(e).__name__}: {e}", is_shutdown=False))
            return
        self._fresh.append(job.request_id)
        self._tracked[job.request_id] = _Tracked(job, cmd.sink)
        cmd.sink.put(Accepted())

    def _release(self, leader_id: str) -> None:
        """Add the jobs that waited for `leader_id`'s first token (or its end)."""
        for cmd in self._parked.pop(leader_id, ()):
            self._add(cmd)

    def _abort(self, request_id: str) -> None:
        for leader_id, cmds in self._parked.items():
            kept = [c for c in cmds if c.job.request_id != request_id]
            if len(kept) != len(cmds):
                self._parked[leader_id] = kept
                return
        if request_id not in self._tracked:
            return
        self._engine.abort_request(request_id)
        self._finish(request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()  # one timestamp per step, as vLLM stamps each engine core output
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue
            if out.new_token_ids:
                if t.has_output:
                    self._token_gap(now - t.last_token_ts)
                t.last_token_ts = now
            if not t.has_output and out.new_token_ids:
                t.has_output = True
                self._release(out.request_id)
            if out.finished:
                self._finish(out.request_id)
            elif t.job.stream and out.new_token_ids:
                logprobs = out.new_logprobs if t.job.sampling.logprobs is not None else None
                t.num_sent_tokens += len(out.new_token_ids)
                t.sink.put(Tokens(list(out.new_token_ids), logprobs))

    def _token_gap(self, seconds: float) -> None:
        if self.on_token_gap is not None:
            try:
                self.on_token_gap(seconds)
            except Exception:  # noqa: BLE001 - metrics must not take the loop down
                logger.exception("on_token_gap callback failed")

    def _finish(self, request_id: str) -> None:
        t = self._tracked.pop(request_id)
        result = self._engine.pop_result(request_id)
        if self.on_finished is not None:
            try:
                self.on_finished(result)
            except Exception:  # noqa: BLE001 - metrics must not take the loop down
                logger.exception("on_finished callback failed")
        t.sink.put(Finished(result, result.stop_reason, result.kv_transfer_params))
        self._release(request_id)

    def _finish_stragglers(self) -> None:
        # The engine is idle but some request never reported its end: end it rather than hang its client.
        for request_id in list(self._tracked):
            logger.warning("request %s ended without a final output", request_id)
            self._engine.abort_request(request_id)
            self._finish(request_id)

    def _failed(self) -> Failed:
        if self.error is not None:
            return Failed(self.error, is_shutdown=False)
        return Failed("the server is shutting down", is_shutdown=True)

    def _end_all(self) -> None:
        """Abort what is in flight, fail what is still queued, close the engine.

        After a normal stop, requests in flight end as aborted; after an engine failure they fail.
        """
        engine = self._engine
        for request_id in list(self._tracked):
            if self.error is None:
                try:
                    engine.abort_request(request_id)
                    self._finish(request_id)
                    continue
                except Exception:  # noqa: BLE001
                    logger.exception("aborting request %s at shutdown failed", request_id)
            t = self._tracked.pop(request_id, None)
            if t is not None:
                t.sink.put(self._failed())
        for cmds in self._parked.values():
            for cmd in cmds:
                cmd.sink.put(self._failed())
        self._parked.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.sink.put(self._failed())
            elif isinstance(cmd, _ResetPrefixCache):
                cmd.done.set_exception(KVToolError(self._failed().message))
        try:
            engine.close()
        except KVToolError as e:  # a failure the engine names itself: one line
            logger.error("closing the engine failed (pending KV stores may be lost): %s", e)
        except Exception:  # noqa: BLE001
            logger.exception("closing the engine failed (pending KV stores may be lost)")
