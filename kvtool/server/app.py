"""The FastAPI app: routes, lifespan and graceful shutdown over one EngineLoop.

The server is split by role: `completions.py` and `chat.py` (the two generation routes),
`admin.py` (health, metrics, version, models, tokenize), `streaming.py` (engine requests and
their server-sent events), `request_body.py` and `json_bounds.py` (bodies nested too deep or
too large), `sampling.py` (request fields to SamplingParams), `errors.py`
(OpenAI's error shape, the API key), `protocol.py` (bodies), `engine_loop.py` (the one thread
that steps the engine). Handlers tokenize in a worker thread and hand jobs to the EngineLoop;
they never call the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvtool import __version__
from kvtool.server.admin import add_admin_routes
from kvtool.server.chat import create_chat_completion
from kvtool.server.completions import create_completion
from kvtool.server.context import ServerContext, ServerSettings
from kvtool.server.engine_loop import EngineLoop
from kvtool.server.errors import APIError, RequireAPIKey, add_error_handlers
from kvtool.server.metrics import ServerMetrics
from kvtool.server.protocol import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse
from kvtool.server.request_body import add_body_bounds
from kvtool.server.router_endpoints import add_router_routes

if TYPE_CHECKING:
    from kvtool.engine.engine import LLMEngine

__all__ = ["APIError", "ServerSettings", "create_app"]


def create_app(
    engine: LLMEngine,
    settings: ServerSettings,
    *,
    tokenizer=None,
    on_ready: Callable[[], None] | None = None,
    shutdown_requested: Callable[[], bool] | None = None,
    grace_s: float = 2.0,
) -> FastAPI:
    """The app over `engine`, which its EngineLoop owns from startup on and closes at shutdown.

    tokenizer: the one requests are rendered with (default: the engine's; `--chat-template`
    passes one with another template). on_ready() is called once the engine loop runs, before the
    first request is served. shutdown_requested() turns true when the server begins to stop
    (uvicorn's should_exit): from then on new requests get 503, those in flight have grace_s
    seconds to finish, and the rest are aborted, so that their streams still end properly.
    """
    engine_loop = EngineLoop(engine)
    metrics = ServerMetrics(settings.served_model_names[0], engine_loop.stats, engine_loop.queue_counts,
                            max_model_len=engine_loop.max_model_len, has_connector=engine.scheduler.connector is not None)
    engine_loop.on_finished = metrics.observe_finished
    engine_loop.on_token_gap = metrics.observe_token_gap
    ctx = ServerContext(engine_loop, tokenizer if tokenizer is not None else engine.tokenizer, settings)

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
    add_router_routes(app)
    # Outside the router's middleware, which parses the body: nothing parses a body nested too deep.
    add_body_bounds(app)
    if settings.api_key is not None:
        app.add_middleware(RequireAPIKey, api_key=settings.api_key)
    add_error_handlers(app)
    add_admin_routes(app, ctx, metrics)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    return app
