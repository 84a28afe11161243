"""OpenAI-style error bodies, and the exception handlers that produce them."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}


class APIError(Exception):
    """An error that reaches the client as `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


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
    """Make every error, including FastAPI's own 404/405/422, use the OpenAI body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"No route for {request.method} {request.url.path}."
        return APIError(message, status_code=exc.status_code).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error while serving a request")
        return APIError(f"Internal server error: {exc!r}", status_code=500).response()
