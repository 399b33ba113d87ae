"""What vLLM's router (`vllm-router`) asks of a worker beyond the OpenAI routes, as vLLM has it.

- `POST /tokenize` and `POST /detokenize`, vLLM's shapes: the router tokenizes a completion
  prompt to route on token ids when the worker can (it falls back to the text otherwise).
- The router re-encodes every request it forwards with its own defaults for fields kvtool does
  not take (`no_stop_trim`, `skip_special_tokens`, ...). vLLM ignores unknown fields; kvtool
  refuses them. Those fields are dropped here when they hold the value that asks for what kvtool
  does anyway (kvtool decodes skipping special tokens, trims stop strings, has no reasoning
  parser and no hidden-state output); any other value still reaches the request models and is
  refused there as an unrecognized argument.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

# Field -> the value that changes nothing in kvtool (vllm-router 0.1.17's defaults).
ROUTER_NEUTRAL_FIELDS: dict[str, Any] = {
    "no_stop_trim": False,
    "return_hidden_states": False,
    "skip_special_tokens": True,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "include_reasoning": True,
}
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def add_router_routes(
    app: FastAPI, tokenizer, served_model_names: Sequence[str], max_model_len: Callable[[], int]
) -> None:
    """Add /tokenize and /detokenize, and accept the router's neutral defaults on /v1 generation."""
    app.add_middleware(_DropRouterDefaults)

    def wrong_model(model: str | None) -> JSONResponse | None:
        if model is None or model in served_model_names:
            return None
        return _error(400, f"The model `{model}` does not exist; this server serves {', '.join(served_model_names)}.",
                      param="model", code="model_not_found")

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest) -> JSONResponse:
        if (refusal := wrong_model(body.model)) is not None:
            return refusal
        if isinstance(body, TokenizeChatRequest):
            kwargs = dict(body.chat_template_kwargs or {})
            if {"messages", "add_generation_prompt"} & kwargs.keys():
                return _error(400, "chat_template_kwargs may not set messages or add_generation_prompt",
                              param="chat_template_kwargs")

            def encode() -> list[int]:
                text = tokenizer.apply_chat_template(body.messages, add_generation_prompt=body.add_generation_prompt,
                                                     **kwargs)
                return tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        else:
            def encode() -> list[int]:
                return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)

        ids = await anyio.to_thread.run_sync(encode)
        strs = [tokenizer.decode([i], skip_special_tokens=False) for i in ids] if body.return_token_strs else None
        reply = TokenizeResponse(count=len(ids), max_model_len=max_model_len(), tokens=ids, token_strs=strs)
        return JSONResponse(reply.model_dump())

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        if (refusal := wrong_model(body.model)) is not None:
            return refusal
        text = await anyio.to_thread.run_sync(lambda: tokenizer.decode(body.tokens))
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


class _DropRouterDefaults:
    """ASGI middleware: drop ROUTER_NEUTRAL_FIELDS holding their neutral value from a JSON body
    POSTed to /v1/completions or /v1/chat/completions; everything else passes untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in _GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message]), send)  # a disconnect: pass it on
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = _without_neutral_fields(b"".join(chunks))
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers}, _replay([{"type": "http.request", "body": body}], receive), send)


def _without_neutral_fields(body: bytes) -> bytes:
    try:
        doc = json.loads(body)
    except ValueError:
        return body  # the request models answer malformed JSON
    if not isinstance(doc, dict):
        return body
    dropped = {k for k, v in ROUTER_NEUTRAL_FIELDS.items() if k in doc and doc[k] is v}
    if not dropped:
        return body
    return json.dumps({k: v for k, v in doc.items() if k not in dropped}).encode()


def _replay(messages: list[dict], then=None):
    pending = list(messages)

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
