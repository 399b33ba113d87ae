"""Request bodies in ASGI middleware: read whole, handed on again, and refused when nested too deep.

Middleware that looks at a body reads it whole with `read_body` and hands the app a `replay`
of it. `RefuseDeepBodies` is the first to do so: a POST body that nests JSON deeper than
json_bounds.MAX_JSON_DEPTH gets a 400 naming the top-level field at fault before anything
parses it, since the JSON parser and the request models behind it recurse once per level.
"""

from __future__ import annotations

from fastapi import FastAPI

from kvtool.server.errors import APIError
from kvtool.server.json_bounds import JSONTooBig, refuse_deep_json


async def read_body(receive) -> tuple[bytes, dict | None]:
    """The whole body of an http request, and the message that cut it short (a disconnect), if any."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


def replay(messages: list[dict], then=None):
    """An ASGI receive() that gives `messages` first, then what `then()` gives (the client's
    disconnect, which handlers watch for), or a disconnect when there is no `then`."""
    pending = list(messages)

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive


def add_body_bounds(app: FastAPI) -> None:
    """Refuse POST bodies nested too deep (a 400 in OpenAI's error shape), on every route."""
    app.add_middleware(RefuseDeepBodies)


class RefuseDeepBodies:
    """ASGI middleware: measure the nesting of a POST body before the app parses it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body, cut = await read_body(receive)
        if cut is not None:
            await self.app(scope, replay([cut]), send)
            return
        try:
            refuse_deep_json(body.decode("utf-8", errors="replace"))
        except JSONTooBig as e:
            message = str(e)
            await APIError(400, message[0].upper() + message[1:], param=e.field).response()(scope, receive, send)
            return
        await self.app(scope, replay([{"type": "http.request", "body": body}], receive), send)
