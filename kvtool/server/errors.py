"""OpenAI's error shape, the app's exception handlers, and the API-key check.

Errors look like `{"error": {"message", "type", "param", "code"}}`: 400 for invalid requests (the
engine's InputError included), 401 for a missing or wrong API key, 500 for a request that failed
(a KV load failure under the `fail` policy, or an exception while it ran), 503 while the engine
loop is not running.
"""

from __future__ import annotations

import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtool.engine.errors import InputError
from kvtool.engine.outputs import RequestResult
from kvtool.server.engine_loop import Failed
from kvtool.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
                405: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


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


def failed_error(event: Failed) -> APIError:
    return APIError(503 if event.is_shutdown else 500, event.message)


def kv_load_error(r: RequestResult) -> APIError:
    return APIError(500, r.error or "the request's external KV failed to load", code="kv_load_failed")


def input_error(e: Exception) -> APIError:
    return APIError(400, str(e), param=getattr(e, "param", None))


class RequireAPIKey:
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


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line and the field at fault, from pydantic's validation errors."""
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


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InputError)
    async def input_error_handler(request: Request, exc: InputError) -> JSONResponse:
        return input_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return APIError(exc.status_code, detail).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
