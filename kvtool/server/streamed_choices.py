"""The body of a streamed reply, shared by /v1/completions and /v1/chat/completions.

After its opening chunks, a stream is the same for both endpoints: each choice's text deltas as
its tokens come, its closing chunk (finish reason, the text left), an error event after a
choice that ended in error, then usage when asked for and [DONE]. Only the chunks' shape differs:
the endpoint passes `chunk` (one choice's delta as an SSE line) and `usage_chunk`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from kvtool.engine.outputs import RequestResult
from kvtool.server.engine_loop import Failed, Finished, Tokens
from kvtool.server.errors import failed_error, kv_load_error
from kvtool.server.streaming import DONE, IncrementalText, RequestHandle, merged_events, sse_error

# chunk(choice index, text delta, token ids, logprobs, {"finish_reason": ..., "stop_reason": ...}) -> SSE line,
# or None when the step has nothing to send (text a tool-call parser holds back).
ChunkFn = Callable[[int, str, list[int], list[dict[int, float]], dict[str, Any]], str | None]


async def stream_choices(handles: list[RequestHandle], texts: list[IncrementalText], chunk: ChunkFn, *,
                         every_step: bool, usage_chunk: Callable[[list[RequestResult]], str] | None
                         ) -> AsyncIterator[str]:
    """SSE lines of every choice, interleaved as their events come, then usage (if usage_chunk) and [DONE].

    every_step: a chunk for each step that gave tokens, even with no new text (logprobs, token
    ids); otherwise only steps whose text grew. A failed request ends the stream with an error
    event; a client that went away ends it with nothing more.
    """
    results: list[RequestResult | None] = [None] * len(handles)
    async for i, event in merged_events(handles):
        if isinstance(event, Tokens):
            delta = texts[i].push(event.token_ids)
            if delta or every_step:
                line = chunk(i, delta, event.token_ids, event.logprobs or [], {"finish_reason": None})
                if line is not None:
                    yield line
        elif isinstance(event, Finished):
            r = event.result
            results[i] = r
            n = texts[i].num_tokens
            final = {"finish_reason": r.finish_reason, "stop_reason": event.stop_reason}
            line = chunk(i, texts[i].finish(r.text), r.output_token_ids[n:], (r.logprobs or [])[n:], final)
            if line is not None:
                yield line
            if r.finish_reason == "error":
                yield sse_error(kv_load_error(r))
        elif isinstance(event, Failed):
            yield sse_error(failed_error(event))
            yield DONE
            return
    if None in results:
        return  # the client went away
    if usage_chunk is not None:
        yield usage_chunk(results)  # type: ignore[arg-type] - every choice has its result here
    yield DONE
