"""What a step's results become for callers, after the scheduler has applied them (vLLM's OutputProcessor).

`process` takes the RequestOutputs of `Scheduler.update_from_output` and, in this order, feeds
each sampled token to the request's grammar, stamps the first token's time, ends a request whose
newest text holds one of its stop strings (through the scheduler, which frees its blocks), and
stamps the finish time. `result` turns a finished request into its RequestResult: the
detokenised text (cut before a stop string), the timings, the counts.

It keeps no request state of its own: the scheduler's registry holds every request until the
engine takes its result.
"""

from __future__ import annotations

import time

from kvtool.engine.core.request import Request, RequestStatus
from kvtool.engine.core.scheduler import Scheduler
from kvtool.engine.core.structured_output import StructuredOutputs
from kvtool.engine.outputs import RequestOutput, RequestResult, RequestStats


class OutputProcessor:
    def __init__(self, tokenizer, structured: StructuredOutputs, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.structured = structured
        self.scheduler = scheduler

    def process(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Grammar advance, timings and stop strings for one step's outputs (changed in place)."""
        if self.structured:
            for out in outputs:
                if out.request_id in self.structured:
                    self.structured.advance(out.request_id, out.new_token_ids)
        now = time.perf_counter()
        requests = self.scheduler.requests
        for out in outputs:
            req = requests[out.request_id]
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
        return outputs

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

    def result(self, req: Request) -> RequestResult:
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
                num_external_loaded_from_disk=req.num_external_loaded_from_disk,
                num_external_stored_tokens=req.num_external_stored_tokens,
                num_preemptions=req.num_preemptions,
                ttft_s=ttft,
                decode_s=decode,
                queue_s=queue_s,
                prefill_s=prefill_s,
            ),
        )
