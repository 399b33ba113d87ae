"""What vLLM's router (`vllm-router`) asks of a worker beyond the OpenAI routes, as vLLM has it.

- `POST /tokenize` and `POST /detokenize` (admin.py): the router tokenizes a completion prompt
  to route on token ids when the worker can (it falls back to the text otherwise).
- The router re-encodes every request it forwards with its own defaults for fields kvtool does
  not take (`no_stop_trim`, `skip_special_tokens`, ...). vLLM ignores unknown fields; kvtool
  refuses them. Those fields are dropped here when they hold the value that asks for what kvtool
  does anyway (kvtool decodes skipping special tokens, trims stop strings, has no reasoning
  parser and no hidden-state output); any other value still reaches the request models and is
  refused there as an unrecognized argument.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI

from kvtool.server.request_body import read_body, replay

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


def add_router_routes(app: FastAPI) -> None:
    """Accept the router's neutral defaults on the /v1 generation routes (/tokenize and
    /detokenize, which it also asks for, are admin.py's)."""
    app.add_middleware(_DropRouterDefaults)


class _DropRouterDefaults:
    """ASGI middleware: drop ROUTER_NEUTRAL_FIELDS holding their neutral value from a JSON body
    POSTed to /v1/completions or /v1/chat/completions; everything else passes untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in _GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        body, cut = await read_body(receive)
        if cut is not None:
            await self.app(scope, replay([cut]), send)  # a disconnect: pass it on
            return
        body = _without_neutral_fields(body)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers}, replay([{"type": "http.request", "body": body}], receive), send)


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

