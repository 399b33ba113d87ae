"""The routes around generation: /health, /metrics, /version, /v1/models, /tokenize, /detokenize,
/reset_prefix_cache."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from kvtool import __version__
from kvtool.engine.errors import KVToolError
from kvtool.server.context import ServerContext
from kvtool.server.errors import APIError
from kvtool.server.protocol import ChatMessage, ModelCard, ModelList, TokenIds
from kvtool.server.streaming import json_response


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: Annotated[str, Field(max_length=1 << 24)] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


def add_admin_routes(app: FastAPI, ctx: ServerContext, metrics) -> None:
    engine_loop = ctx.engine_loop

    @app.get("/health")
    async def health() -> Response:
        if not engine_loop.is_running:
            return APIError(503, engine_loop.error or "the engine loop is not running").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__}

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> Response:
        cards = [
            ModelCard(id=name, created=ctx.started, root=ctx.settings.model_root, max_model_len=ctx.max_model_len)
            for name in ctx.settings.served_model_names
        ]
        return json_response(ModelList(data=cards), exclude_unset=False)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> Response:
        ctx.check_model(body.model)
        tok = ctx.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "/tokenize takes exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            text = tok.apply_chat_template([m.to_template() for m in body.messages],
                                           add_generation_prompt=body.add_generation_prompt)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ctx.check_text_length(body.prompt)
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        resp = TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)
        if body.return_token_strs:
            resp.token_strs = [ctx.token_string(i) for i in ids]
        return json_response(resp, exclude_unset=False)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> Response:
        ctx.check_model(body.model)
        vocab = ctx.engine_loop.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range for a vocabulary of {vocab}", param="tokens")
        return json_response(DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens)))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(default=False),
                                 reset_external: bool = Query(default=False)) -> Response:
        """vLLM's endpoint: forget the device prefix cache, and with `reset_external=true` the
        connector's CPU tier too (never a disk tier or a remote store). `{"success": false}`
        while blocks are still held (running requests, unless `reset_running_requests=true`
        preempts them; transfers in flight): the caller may retry."""
        try:
            ok = await engine_loop.reset_prefix_cache(reset_running_requests, reset_external)
        except KVToolError as e:
            return APIError(503, str(e)).response()
        return JSONResponse({"success": bool(ok)})
