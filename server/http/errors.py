"""Error bodies in the style of the API that was called, and the handlers that produce them.

OpenAI routes answer `{"error": {message, type, param, code}}`; Anthropic routes
(`/v1/messages...`) answer `{"type": "error", "error": {type, message}}`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.async_engine import QueueFull

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
    405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
    429: "rate_limit_error",
}  # fmt: skip
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error", 529: "overloaded_error",
}  # fmt: skip


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class APIError(Exception):
    """An error that reaches the client as the error body of the API it called."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        error_type = _ANTHROPIC_TYPES.get(self.status_code, "api_error")
        return {"type": "error", "error": {"type": error_type, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The response for a request to `path`, in that API's style."""
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


def request_too_large() -> APIError:
    return APIError(
        "The request body is larger than this server accepts; send less, or start the server "
        "with a higher --max-request-body.",
        status_code=413,
        code="request_too_large",
    )


def _queue_full_error(exc: QueueFull) -> APIError:
    return APIError(
        str(exc), status_code=429, code="rate_limit_exceeded",
        headers={"Retry-After": str(exc.retry_after_s)},
    )  # fmt: skip


def validation_error(exc: RequestValidationError) -> APIError:
    """Turn FastAPI's 422 into a 400 whose message names the field and the problem."""
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        first = next(e for e in errors if e.get("type") == "json_invalid")
        detail = first.get("ctx", {}).get("error", "JSON decode error")
        return APIError(f"The request body is not valid JSON: {detail}.", code="invalid_json")
    parts = []
    for error in errors[:3]:
        # loc starts with "body"; pydantic appends the union member it tried, e.g. "str".
        field = ".".join(str(p) for p in error.get("loc", ())[1:])
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{field or 'body'}: {message}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    first_loc = errors[0].get("loc", ()) if errors else ()
    param = str(first_loc[1]) if len(first_loc) > 1 else None
    return APIError("Invalid request: " + "; ".join(parts) + more, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error, including FastAPI's own 404/405/422, use the caller's API style."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(QueueFull)
    async def _queue_full(request: Request, exc: QueueFull) -> JSONResponse:
        return _queue_full_error(exc).response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _http_error(request, exc).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error while serving a request")
        # The log has the details; the exception text may hold what the request sent.
        error = APIError("Internal server error; the server log has the details.", status_code=500)
        return error.response(request.url.path)


def _http_error(request: Request, exc: StarletteHTTPException) -> APIError:
    """Starlette's own errors (no route, wrong method) and a body over the size limit."""
    if exc.status_code == 404:
        return APIError(f"No route for {request.method} {request.url.path}.", status_code=404)
    if exc.status_code == 413:
        return request_too_large()
    return APIError(str(exc.detail), status_code=exc.status_code)
    if exc.status_code == 408:  # a body slower than --client-timeout
        return APIError(str(exc.detail), status_code=408, code="request_timeout")
