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
from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.async_engine import QueueFull
from server.http.client_presence import ClientGone

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
    405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
    415: "invalid_request_error", 429: "rate_limit_error",
}  # fmt: skip
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error",
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


Problem = tuple[tuple[str | int, ...], str]  # (location in a model, what is wrong there)


def invalid_at(*problems: Problem) -> ValidationError:
    """For a model validator: an error for each (location, message), the location relative to
    the model being validated. pydantic puts the model's own location before it, so the 400
    names the field (`messages[2].tool_call_id`), not the message that holds it."""
    errors = [
        InitErrorDetails(type=PydanticCustomError("invalid_field", message), loc=loc, input=None)
        for loc, message in problems
    ]
    return ValidationError.from_exception_data("request", errors)


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


def validation_error(exc: RequestValidationError, path: str = "") -> APIError:
    """Turn FastAPI's 422 into a 400 whose `param` is the bad field's path, as OpenAI names it
    (`messages[1].content[0].text`; Anthropic's `messages.1.content.0.text` for a request to
    `path` on that API), and whose message says what is wrong there."""
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        first = next(e for e in errors if e.get("type") == "json_invalid")
        detail = first.get("ctx", {}).get("error", "JSON decode error")
        return APIError(f"The request body is not valid JSON: {detail}.", code="invalid_json")
    found = _field_errors(errors)
    dotted = is_anthropic_path(path)
    parts = [f"{_param(loc, dotted) or 'body'}: {message}" for _, loc, message in found[:3]]
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    param = _param(found[0][0], dotted) if found else None
    return APIError("Invalid request: " + "; ".join(parts) + more, param=param)


# pydantic puts the union member it tried into the location ("str", "list[ContentPart]",
# "NamedToolChoice"); field names are lower-case words without brackets.
_SCALAR_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none"})
_QUOTE_LIMIT = 64  # a location part (a dict key may be the client's) is cut to this
_MESSAGE_LIMIT = 300


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _SCALAR_TAGS or "[" in part or part[:1].isupper())


def _field_errors(errors: list[dict[str, Any]]) -> list[tuple[tuple, tuple, str]]:
    """(param path, path, message) per bad field, union members' tags out of the paths. Of
    a union that failed, only the members that got furthest count (a list of parts whose
    third part lacks its text, not "should be a string"); when several did, the param is
    the path they share (`tool_choice`, not the `type` of one of its shapes). Messages at one
    path are joined with ", or"."""
    parsed = [_untagged(error) for error in errors]
    furthest: dict[tuple, list[tuple]] = {}  # union site -> the furthest paths into it
    for path, site, _ in parsed:
        if site is not None:
            kept = furthest.setdefault(site, [])
            if not kept or len(path) > len(kept[0]):
                kept[:] = [path]
            elif len(path) == len(kept[0]):
                kept.append(path)
    by_path: dict[tuple, tuple[tuple, list[str]]] = {}
    for path, site, message in parsed:
        kept = furthest[site] if site is not None else [path]
        if path in kept:
            _, messages = by_path.setdefault(path, (_shared_prefix(kept), []))
            if message not in messages:
                messages.append(message)
    return [
        (param, path, clip(_either(messages), _MESSAGE_LIMIT))
        for path, (param, messages) in by_path.items()
    ]


def _untagged(error: dict[str, Any]) -> tuple[tuple, tuple | None, str]:
    """(the error's path without "body" and union tags, the path up to its first union
    or None, its message)."""
    path: list[object] = []
    site: tuple | None = None
    for part in error.get("loc", ())[1:]:
        if _is_union_tag(part):
            site = tuple(path) if site is None else site
        else:
            path.append(part)
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return tuple(path), site, message


def _shared_prefix(paths: list[tuple]) -> tuple:
    shared = paths[0]
    for path in paths[1:]:
        while path[: len(shared)] != shared:
            shared = shared[:-1]
    return shared


def _either(messages: list[str]) -> str:
    prefix = "Input should be "
    if len(messages) > 1 and all(m.startswith(prefix) for m in messages):
        return prefix + ", or ".join(m.removeprefix(prefix) for m in messages)
    return ", or ".join(messages)


def _param(path: tuple, dotted: bool = False) -> str | None:
    """`("messages", 1, "content")` as `messages[1].content` (`dotted`: `messages.1.content`)."""
    param = ""
    for part in path:
        if isinstance(part, int) and not dotted:
            param += f"[{part}]"
        else:
            param += ("." if param else "") + clip(str(part), _QUOTE_LIMIT)
    return param or None


def clip(text: str, limit: int = 40) -> str:
    """`text` cut to `limit` characters, for quoting what a client sent in an error."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Make every error, including FastAPI's own 404/405/422, use the caller's API style."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(QueueFull)
    async def _queue_full(request: Request, exc: QueueFull) -> JSONResponse:
        return _queue_full_error(exc).response(request.url.path)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> JSONResponse:
        # Nobody reads it; the status (nginx's "client closed request") is for the log.
        error = APIError("The client disconnected before its request ran.", status_code=499,
                         code="client_closed_request")
        return error.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request.url.path).response(request.url.path)

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
