"""kvtool's arms of `kvtool bench serve`: the trace sent to an in-process engine at an offered load.

The engine runs behind the loop `kvtool serve` runs it behind (server/engine_loop.py): one thread
steps it for every request at once, and each request streams its tokens back to an asyncio task
(an EventSink), as a server's handler gets them, with no HTTP in between. The client side, one
asyncio task per request, sleeps until the request's arrival time, takes a slot when
--max-concurrency limits them, sends it, and stamps when its first token and its end arrive.

Every request of a run carries the run's own cache_salt, so nothing an earlier run (another
rate, the warm-up) left in a cache can hit; a run starts from caches whose entries are all
foreign to it, as the next rate of a benchmark would find them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvtool.engine.engine import LLMEngine
from kvtool.engine.outputs import StepTimes
from kvtool.engine.params import SamplingParams
from kvtool.server.engine_loop import Accepted, EngineLoop, EventSink, Failed, Finished, GenerationJob, Rejected, Tokens
from kvtool.workloads.serve_metrics import RequestTiming

# Called once per finished request.
Tick = Callable[[], None]


class ServeRequest:
    """A request of the trace as every arm sends it: token ids and a fixed output length."""

    __slots__ = ("prompt_token_ids", "max_tokens")

    def __init__(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.max_tokens = max_tokens

    def sampling(self) -> SamplingParams:
        """Greedy, EOS ignored: every arm produces exactly max_tokens tokens."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)


class EngineRuns:
    """One engine behind its loop, for the runs of one arm; close() closes the engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._loop = EngineLoop(engine)
        self._loop.start()
        self._num_runs = 0
        # The engine's host seconds by phase over the last run (read between runs, when the loop idles).
        self.last_host: StepTimes | None = None

    def run(self, requests: list[ServeRequest], arrivals: list[float], *, max_concurrency: int | None, salt: str,
            tick: Tick | None = None) -> list[RequestTiming]:
        """Send every request at its arrival time; one record per request, in trace order."""
        self._num_runs += 1
        before = self._engine.step_times()
        records = asyncio.run(self._run_all(requests, arrivals, max_concurrency, salt, tick, f"run{self._num_runs}"))
        self.last_host = self._engine.step_times().minus(before)
        return records

    def close(self) -> None:
        self._loop.shutdown()

    async def _run_all(self, requests, arrivals, max_concurrency, salt, tick, run_id) -> list[RequestTiming]:
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        t0 = time.perf_counter()

        async def one(i: int) -> RequestTiming:
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
            if slots is not None:
                await slots.acquire()
            try:
                return await self._send(i, requests[i], arrivals[i], salt, f"{run_id}-{i}", t0)
            finally:
                if slots is not None:
                    slots.release()
                if tick is not None:
                    tick()

        return list(await asyncio.gather(*(one(i) for i in range(len(requests)))))

    async def _send(self, i: int, req: ServeRequest, arrival: float, salt: str, request_id: str,
                    t0: float) -> RequestTiming:
        sink = EventSink()
        rec = RequestTiming(index=i, arrival_s=arrival, num_prompt_tokens=len(req.prompt_token_ids))
        rec.send_s = time.perf_counter() - t0
        self._loop.add(GenerationJob(request_id=request_id, prompt_token_ids=req.prompt_token_ids,
                                     sampling=req.sampling(), cache_salt=salt, stream=True), sink)
        while True:
            event = await sink.get()
            now = time.perf_counter() - t0
            if isinstance(event, Accepted):
                continue
            if isinstance(event, Tokens):
                if rec.first_token_s is None and event.token_ids:
                    rec.first_token_s = now
                continue
            rec.finish_s = now
            if isinstance(event, Finished):
                result = event.result
                if rec.first_token_s is None and result.output_token_ids:
                    rec.first_token_s = now  # its only step gave every token
                rec.output_token_ids = list(result.output_token_ids)
                rec.num_output_tokens = len(result.output_token_ids)
                rec.num_cached_tokens = result.stats.num_cached_tokens
                rec.num_loaded_tokens = result.stats.num_external_loaded_tokens
                rec.num_loaded_from_disk = result.stats.num_external_loaded_from_disk
                if result.finish_reason not in ("length", "stop") or result.error:
                    rec.error = result.error or f"the request ended with finish_reason {result.finish_reason!r}"
            elif isinstance(event, Rejected):
                rec.error = str(event.error)
            elif isinstance(event, Failed):
                rec.error = event.message
            return rec
