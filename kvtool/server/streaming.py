"""The requests of one HTTP call between the HTTP side and the engine loop, and their text.

A call makes one engine request per choice (n choices per prompt, one or more prompts); each is a
RequestHandle with its own EventSink and disconnect watcher. `start_all` queues them (refusing
the call if the engine refuses any), `wait_all` collects their Finished events, and
`merged_events` interleaves their events as they come, tagged with the choice index, for
streaming. A request whose client disconnects is aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from kvtool.server.engine_loop import Accepted, EngineLoop, EventSink, Failed, Finished, GenerationJob, Rejected
from kvtool.server.errors import APIError, failed_error, input_error, kv_load_error
from kvtool.server.protocol import ErrorResponse

DONE = "data: [DONE]\n\n"


class ClientGone:
    """Put on a request's sink by its disconnect watcher."""


class RequestHandle:
    """One engine request: its sink and its disconnect watcher."""

    def __init__(self, engine_loop: EngineLoop, job: GenerationJob, request: Request) -> None:
        self.engine_loop = engine_loop
        self.job = job
        self.request = request
        self.sink = EventSink()
        self.watcher: asyncio.Task | None = None
        self.done = False

    def queue(self) -> None:
        self.engine_loop.add(self.job, self.sink)

    async def accepted(self) -> None:
        """Wait for the engine's answer; raises APIError when it refused or failed the request."""
        event = await self.sink.get()
        if isinstance(event, Rejected):
            self.done = True
            raise input_error(event.error)
        if isinstance(event, Failed):
            self.done = True
            raise failed_error(event)
        assert isinstance(event, Accepted)
        self.watcher = asyncio.create_task(self._watch_disconnect())

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                break
        self.engine_loop.abort(self.job.request_id)
        self.sink.put_nowait(ClientGone())

    async def next_event(self) -> object:
        event = await self.sink.get()
        if isinstance(event, (Finished, Failed, ClientGone)):
            self.done = True
        return event

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        if not self.done:
            self.done = True
            self.engine_loop.abort(self.job.request_id)


async def start_all(engine_loop: EngineLoop, jobs: list[GenerationJob], request: Request) -> list[RequestHandle]:
    """Queue every job (together, so they share steps and the prompt's cached blocks); when the
    engine refuses one, the others are aborted and its error is raised."""
    handles = [RequestHandle(engine_loop, job, request) for job in jobs]
    for h in handles:
        h.queue()
    error: APIError | None = None
    for h in handles:
        try:
            await h.accepted()
        except APIError as e:
            error = error or e
    if error is not None:
        close_all(handles)
        raise error
    return handles


def close_all(handles: list[RequestHandle]) -> None:
    for h in handles:
        h.close()


async def wait_all(handles: list[RequestHandle]) -> list[Finished] | None:
    """The Finished event of every (non-streamed) request; None when the client went away."""
    try:
        events = [await h.next_event() for h in handles]
    finally:
        close_all(handles)
    for event in events:
        if isinstance(event, Failed):
            raise failed_error(event)
    if not all(isinstance(e, Finished) for e in events):
        return None
    for event in events:
        if event.result.finish_reason == "error":
            raise kv_load_error(event.result)
    return events  # type: ignore[return-value]


async def merged_events(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, object]]:
    """(choice index, event) of every handle as they arrive, until each has ended (or the client left)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        while True:
            event = await h.next_event()
            await queue.put((i, event))
            if isinstance(event, (Finished, Failed, ClientGone)):
                return

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        open_count = len(handles)
        while open_count:
            i, event = await queue.get()
            if isinstance(event, ClientGone):
                return
            if isinstance(event, (Finished, Failed)):
                open_count -= 1
            yield i, event
    finally:
        for t in tasks:
            t.cancel()
        close_all(handles)


class IncrementalText:
    """The text of a growing list of output token ids, released in deltas.

    A window of recent tokens is decoded, so each step costs the same however long the output
    is; text ending in an incomplete UTF-8 sequence waits for the next token. When the request has
    stop strings, the last (longest stop - 1) characters are held back, so that text which turns
    out to start a stop string is never sent (the engine cuts the final text there).
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self.num_sent_chars = 0
        self.prefix_offset = 0
        self.read_offset = 0
        self.holdback = max((len(s) for s in stop), default=1) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        end = len(self.text) - self.holdback
        if end <= self.num_sent_chars:
            return ""
        delta = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return delta

    def finish(self, final_text: str) -> str:
        """What is left to send of the engine's final text (already cut at a stop string)."""
        return final_text[self.num_sent_chars :]


@dataclass(slots=True)
class Reply:
    """What every body or chunk of one HTTP call repeats."""

    id: str
    model: str
    created: int
    return_token_ids: bool


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json(exclude_unset=True)}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {ErrorResponse(error=error.info).model_dump_json()}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def json_response(body: BaseModel, exclude_unset: bool = True):
    from fastapi.responses import Response

    # Bodies are built field by field, so exclude_unset leaves out only the extras not asked for.
    return Response(body.model_dump_json(exclude_unset=exclude_unset), media_type="application/json")
