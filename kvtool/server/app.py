"""The FastAPI app: OpenAI's completions, chat completions and models endpoints, health and metrics.

Handlers tokenize (in a worker thread; the tokenizer is safe to share), hand a GenerationJob to
the EngineLoop and turn its events into OpenAI bodies or server-sent events. They never call the
engine. A request whose client disconnects is aborted, which frees its KV blocks.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for invalid
requests (the engine's InputError included), 401 for a missing or wrong API key, 500 for a
request the engine ended with finish_reason "error" (a KV load failure under the `fail` policy),
503 while the engine loop is not running.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtool import __version__
from kvtool.engine.errors import InputError
from kvtool.engine.outputs import RequestResult
from kvtool.server.engine_loop import (
    Accepted,
    EngineLoop,
    EventSink,
    Failed,
    Finished,
    GenerationJob,
    Rejected,
    Tokens,
)
from kvtool.server.metrics import ServerMetrics
from kvtool.server.router_endpoints import add_router_routes
from kvtool.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)

if TYPE_CHECKING:
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import SamplingParams

logger = logging.getLogger(__name__)

# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
_DONE = "data: [DONE]\n\n"
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
                405: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


@dataclass(frozen=True, slots=True)
class ServerSettings:
    # The names clients may put in `model`; the first is the one metrics carry.
    served_model_names: list[str]
    # What /v1/models reports as each model's root (the --model directory or the default's name).
    model_root: str
    # When set, every /v1 route needs `Authorization: Bearer <api_key>`.
    api_key: str | None = None


class APIError(Exception):
    """An error answered with OpenAI's error shape and an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type or _ERROR_TYPES.get(status, "server_error"),
                              param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status)


def create_app(
    engine: LLMEngine,
    settings: ServerSettings,
    *,
    on_ready: Callable[[], None] | None = None,
    shutdown_requested: Callable[[], bool] | None = None,
    grace_s: float = 2.0,
) -> FastAPI:
    """The app over `engine`, which its EngineLoop owns from startup on and closes at shutdown.

    on_ready() is called once the engine loop runs, before the first request is served.
    shutdown_requested() turns true when the server begins to stop (uvicorn's should_exit): from
    then on new requests get 503, those in flight have grace_s seconds to finish, and the rest
    are aborted, so that their streams still end with a final chunk and [DONE].
    """
    engine_loop = EngineLoop(engine)
    metrics = ServerMetrics(settings.served_model_names[0], engine_loop.stats, lambda: engine_loop.num_in_flight)
    engine_loop.on_finished = metrics.observe_finished
    server = _Server(engine_loop, engine.tokenizer, settings)

    async def drain_on_shutdown() -> None:
        while not shutdown_requested():
            await asyncio.sleep(0.1)
        engine_loop.drain(grace_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        watcher = asyncio.create_task(drain_on_shutdown()) if shutdown_requested is not None else None
        if on_ready is not None:
            on_ready()
        yield
        if watcher is not None:
            watcher.cancel()
        # Aborts anything still in flight, then waits for pending KV stores (engine.close()).
        await anyio.to_thread.run_sync(engine_loop.shutdown)

    app = FastAPI(title="kvtool", version=__version__, lifespan=lifespan)
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics
    add_router_routes(app, engine.tokenizer, settings.served_model_names, lambda: engine_loop.max_model_len)
    if settings.api_key is not None:
        app.add_middleware(_RequireAPIKey, api_key=settings.api_key)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not engine_loop.is_running:
            return APIError(503, engine_loop.error or "the engine loop is not running").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> Response:
        cards = [
            ModelCard(id=name, created=server.started, root=settings.model_root, max_model_len=engine_loop.max_model_len)
            for name in settings.served_model_names
        ]
        return _json(ModelList(data=cards), exclude_unset=False)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await server.completion(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat_completion(body, request)

    return app


# ---- the handlers' work ------------------------------------------------------------------------


class _ClientGone:
    """Put on a request's sink by its disconnect watcher."""


class _RequestHandle:
    """One request between the HTTP side and the engine loop: its sink and its disconnect watcher."""

    def __init__(self, engine_loop: EngineLoop, job: GenerationJob, request: Request) -> None:
        self.engine_loop = engine_loop
        self.job = job
        self.request = request
        self.sink = EventSink()
        self.watcher: asyncio.Task | None = None
        self.done = False

    async def start(self) -> None:
        """Queue the job; raises APIError when the engine refuses it or cannot take it."""
        self.engine_loop.add(self.job, self.sink)
        event = await self.sink.get()
        if isinstance(event, Rejected):
            self.done = True
            raise _input_error(event.error)
        if isinstance(event, Failed):
            self.done = True
            raise _failed_error(event)
        assert isinstance(event, Accepted)
        self.watcher = asyncio.create_task(self._watch_disconnect())

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                break
        self.engine_loop.abort(self.job.request_id)
        self.sink.put_nowait(_ClientGone())

    async def next_event(self) -> object:
        event = await self.sink.get()
        if isinstance(event, (Finished, Failed, _ClientGone)):
            self.done = True
        return event

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        if not self.done:
            self.done = True
            self.engine_loop.abort(self.job.request_id)


class _Server:
    def __init__(self, engine_loop: EngineLoop, tokenizer, settings: ServerSettings) -> None:
        self.engine_loop = engine_loop
        self.tokenizer = tokenizer
        self.settings = settings
        self.started = int(time.time())
        self._token_strings: dict[int, str] = {}

    def check_model(self, model: str | None) -> str:
        names = self.settings.served_model_names
        if model is None:
            return names[0]
        if model not in names:
            raise APIError(400, f"The model `{model}` does not exist; this server serves {', '.join(names)}.",
                           param="model", code="model_not_found")
        return model

    def token_string(self, token_id: int) -> str:
        s = self._token_strings.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strings[token_id] = s
        return s

    async def _submit(
        self, id_prefix: str, prompt_ids: list[int], sampling: SamplingParams,
        body: CompletionRequest | ChatCompletionRequest, model: str, request: Request,
    ) -> tuple[_RequestHandle, _Reply]:
        """Start one request's generation; returns its handle and what each of its replies repeats."""
        job = GenerationJob(
            request_id=f"{id_prefix}-{uuid.uuid4().hex}", prompt_token_ids=prompt_ids, sampling=sampling,
            cache_salt=body.cache_salt, kv_transfer_params=body.kv_transfer_params, stream=body.stream,
        )
        handle = _RequestHandle(self.engine_loop, job, request)
        await handle.start()
        return handle, _Reply(job.request_id, model, int(time.time()), body.return_token_ids, prompt_ids)

    async def _wait_final(self, handle: _RequestHandle) -> Finished | None:
        """The Finished event of a non-streamed request; None when its client went away."""
        try:
            event = await handle.next_event()
        finally:
            handle.close()
        if isinstance(event, Failed):
            raise _failed_error(event)
        if not isinstance(event, Finished):
            return None
        if event.result.finish_reason == "error":
            raise _kv_load_error(event.result)
        return event

    # ---- /v1/completions ----------------------------------------------------------------------

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        model = self.check_model(body.model)
        body.refuse_unsupported()
        prompt = body.single_prompt()
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        sampling = body.make_sampling(max_tokens, body.logprobs)
        if isinstance(prompt, str):
            prompt_ids = await anyio.to_thread.run_sync(self.tokenizer.encode, prompt, True)
        else:
            prompt_ids = list(prompt)
        handle, reply = await self._submit("cmpl", prompt_ids, sampling, body, model, request)
        if body.stream:
            return _sse_response(self._completion_stream(handle, reply, body))
        event = await self._wait_final(handle)
        if event is None:
            return Response(status_code=499)
        r = event.result
        logprobs = None
        if body.logprobs is not None:
            logprobs = self._completion_logprobs(r.output_token_ids, r.logprobs or [], 0)
        choice = CompletionChoice(
            index=0, text=r.text, logprobs=logprobs, finish_reason=r.finish_reason, stop_reason=event.stop_reason,
        )
        if body.return_token_ids:
            choice.prompt_token_ids = prompt_ids
            choice.token_ids = r.output_token_ids
        resp = CompletionResponse(
            id=reply.id, object="text_completion", created=reply.created, model=model, choices=[choice],
            usage=_usage(r), kv_transfer_params=event.kv_transfer_params,
        )
        return _json(resp)

    def _completion_stream(self, handle: _RequestHandle, reply: _Reply, body: CompletionRequest) -> AsyncIterator[str]:
        want_logprobs = body.logprobs is not None
        text_offset = 0

        def chunk(delta: str, token_ids: list[int], logprobs: list[dict[int, float]], final: dict[str, Any]) -> str:
            nonlocal text_offset
            choice = CompletionChoice(index=0, text=delta, logprobs=None, **final)
            if want_logprobs:
                choice.logprobs = self._completion_logprobs(token_ids, logprobs, text_offset)
                text_offset += sum(len(t) for t in choice.logprobs.tokens)
            if reply.return_token_ids:
                choice.token_ids = token_ids
                if reply.first_chunk:
                    choice.prompt_token_ids = reply.prompt_token_ids
            reply.first_chunk = False
            return _sse(CompletionResponse(
                id=reply.id, object="text_completion", created=reply.created, model=reply.model, choices=[choice],
            ))

        def usage_chunk(usage: Usage) -> str:
            return _sse(CompletionResponse(
                id=reply.id, object="text_completion", created=reply.created, model=reply.model, choices=[], usage=usage,
            ))

        return _stream_events(
            handle, _IncrementalText(self.tokenizer, body.stop_strings), chunk,
            usage_chunk if body.include_usage else None, every_step=want_logprobs or reply.return_token_ids,
        )

    def _completion_logprobs(self, token_ids: list[int], entries: list[dict[int, float]], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for tid, entry in zip(token_ids, entries):
            s = self.token_string(tid)
            out.tokens.append(s)
            out.token_logprobs.append(entry.get(tid))
            out.top_logprobs.append({self.token_string(i): lp for i, lp in _by_logprob(entry)})
            out.text_offset.append(offset)
            offset += len(s)
        return out

    # ---- /v1/chat/completions -----------------------------------------------------------------

    async def chat_completion(self, body: ChatCompletionRequest, request: Request) -> Response:
        model = self.check_model(body.model)
        body.refuse_unsupported()
        kwargs = dict(body.chat_template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt"):
            if reserved in kwargs:
                raise APIError(400, f"chat_template_kwargs may not set {reserved!r}", param="chat_template_kwargs")
        messages = [m.to_template() for m in body.messages]
        prompt_ids = await anyio.to_thread.run_sync(
            lambda: self.tokenizer.encode(
                self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **kwargs),
                add_special_tokens=False,
            )
        )
        max_tokens = body.requested_max_tokens
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        # The engine caps max_tokens at what the context has left, as OpenAI does when it is unset.
        sampling = body.make_sampling(max_tokens if max_tokens is not None else self.engine_loop.max_model_len, num_top)
        handle, reply = await self._submit("chatcmpl", prompt_ids, sampling, body, model, request)
        if body.stream:
            return _sse_response(self._chat_stream(handle, reply, body, num_top))
        event = await self._wait_final(handle)
        if event is None:
            return Response(status_code=499)
        r = event.result
        logprobs = self._chat_logprobs(r.output_token_ids, r.logprobs or [], num_top) if num_top is not None else None
        choice = ChatChoice(
            index=0, message=AssistantMessage(role="assistant", content=r.text), logprobs=logprobs,
            finish_reason=r.finish_reason, stop_reason=event.stop_reason,
        )
        resp = ChatCompletionResponse(
            id=reply.id, object="chat.completion", created=reply.created, model=model, choices=[choice],
            usage=_usage(r), kv_transfer_params=event.kv_transfer_params,
        )
        if body.return_token_ids:
            choice.token_ids = r.output_token_ids
            resp.prompt_token_ids = prompt_ids
        return _json(resp)

    def _chat_stream(self, handle: _RequestHandle, reply: _Reply, body: ChatCompletionRequest,
                     num_top: int | None) -> AsyncIterator[str]:
        def chunk(delta: str | None, token_ids: list[int] | None, logprobs: list[dict[int, float]],
                  final: dict[str, Any]) -> str:
            # The opening chunk carries the role; the closing one has no content unless text is left.
            if token_ids is None:
                message = DeltaMessage(role="assistant", content="")
            else:
                message = DeltaMessage(content=delta) if delta or final["finish_reason"] is None else DeltaMessage()
            choice = ChatStreamChoice(index=0, delta=message, logprobs=None, **final)
            if num_top is not None and token_ids:
                choice.logprobs = self._chat_logprobs(token_ids, logprobs, num_top)
            if reply.return_token_ids and token_ids is not None:
                choice.token_ids = token_ids
            out = ChatCompletionChunk(
                id=reply.id, object="chat.completion.chunk", created=reply.created, model=reply.model, choices=[choice],
            )
            if reply.return_token_ids and reply.first_chunk:
                out.prompt_token_ids = reply.prompt_token_ids
            reply.first_chunk = False
            return _sse(out)

        def usage_chunk(usage: Usage) -> str:
            return _sse(ChatCompletionChunk(
                id=reply.id, object="chat.completion.chunk", created=reply.created, model=reply.model,
                choices=[], usage=usage,
            ))

        return _stream_events(
            handle, _IncrementalText(self.tokenizer, body.stop_strings), chunk,
            usage_chunk if body.include_usage else None, every_step=num_top is not None or reply.return_token_ids,
            opening=chunk(None, None, [], {"finish_reason": None}),
        )

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict[int, float]], num_top: int) -> ChoiceLogprobs:
        content = []
        for tid, entry in zip(token_ids, entries):
            s = self.token_string(tid)
            top = [
                TopLogprob(token=self.token_string(i), logprob=lp, bytes=list(self.token_string(i).encode()))
                for i, lp in _by_logprob(entry)[:num_top]
            ]
            lp = entry.get(tid)
            content.append(TokenLogprob(token=s, logprob=lp if lp is not None else float("-inf"),
                                        bytes=list(s.encode()), top_logprobs=top))
        return ChoiceLogprobs(content=content)


async def _stream_events(
    handle: _RequestHandle,
    text: _IncrementalText,
    chunk: Callable[[str, list[int], list[dict[int, float]], dict[str, Any]], str],
    usage_chunk: Callable[[Usage], str] | None,
    *,
    every_step: bool,
    opening: str | None = None,
) -> AsyncIterator[str]:
    """Server-sent events of one streamed request, ending in `data: [DONE]`.

    chunk(text delta, token ids, logprobs, final fields) renders one chunk; `final` holds
    finish_reason (None until the last chunk) and, in the last chunk, stop_reason. A step whose
    text is held back still sends a chunk when `every_step` (token ids or logprobs were asked
    for). A request the engine ended with "error" gets its last chunk, then an error event. The
    request is aborted if the stream stops early (client gone, server cancelling the task).
    """
    try:
        if opening is not None:
            yield opening
        while True:
            event = await handle.next_event()
            if isinstance(event, Tokens):
                delta = text.push(event.token_ids)
                if delta or every_step:
                    yield chunk(delta, event.token_ids, event.logprobs or [], {"finish_reason": None})
            elif isinstance(event, Finished):
                r = event.result
                n = text.num_tokens
                final = {"finish_reason": r.finish_reason, "stop_reason": event.stop_reason}
                yield chunk(text.finish(r.text), r.output_token_ids[n:], (r.logprobs or [])[n:], final)
                if r.finish_reason == "error":
                    yield _sse_error(_kv_load_error(r))
                if usage_chunk is not None:
                    yield usage_chunk(_usage(r))
                yield _DONE
                return
            elif isinstance(event, Failed):
                yield _sse_error(_failed_error(event))
                yield _DONE
                return
            else:
                return  # the client went away
    finally:
        handle.close()


@dataclass(slots=True)
class _Reply:
    """What every body or chunk of one request repeats."""

    id: str
    model: str
    created: int
    return_token_ids: bool
    prompt_token_ids: list[int]
    first_chunk: bool = True


class _IncrementalText:
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


def _by_logprob(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])


def _failed_error(event: Failed) -> APIError:
    return APIError(503 if event.is_shutdown else 500, event.message)


def _kv_load_error(r: RequestResult) -> APIError:
    return APIError(500, r.error or "the request's external KV failed to load", code="kv_load_failed")


def _input_error(e: Exception) -> APIError:
    return APIError(400, str(e), param=getattr(e, "param", None))


def _usage(r: RequestResult) -> Usage:
    st = r.stats
    n_out = len(r.output_token_ids)
    return Usage(
        prompt_tokens=st.num_prompt_tokens, completion_tokens=n_out, total_tokens=st.num_prompt_tokens + n_out,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=st.num_cached_tokens + st.num_external_tokens),
    )


def _json(body: BaseModel, exclude_unset: bool = True) -> Response:
    # Bodies are built field by field, so exclude_unset leaves out only the extras not asked for.
    return Response(body.model_dump_json(exclude_unset=exclude_unset), media_type="application/json")


def _sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json(exclude_unset=True)}\n\n"


def _sse_error(error: APIError) -> str:
    return f"data: {ErrorResponse(error=error.info).model_dump_json()}\n\n"


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- authentication and errors -----------------------------------------------------------------


class _RequireAPIKey:
    """ASGI middleware: /v1 routes need `Authorization: Bearer <key>`; checked before the body is read."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if given is None or not hmac.compare_digest(given, self.expected):
                message = "Missing API key: send Authorization: Bearer <key>." if given is None else "Incorrect API key provided."
                await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "invalid JSON")
        return f"The request body is not valid JSON: {detail}.", None
    param = loc[0] if loc else None
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {'.'.join(loc)}", param
    parts = []
    for e in errors[:3]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(parts), param


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InputError)
    async def input_error(request: Request, exc: InputError) -> JSONResponse:
        return _input_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return APIError(exc.status_code, detail).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
