"""`GET /dashboard` (the page and its two assets, shipped in this package) and
`GET /dashboard/state` (the JSON it polls).

The page and assets hold no data and stay open, so a browser can load them; the state needs
an API key when the server has any (`server.http.auth`), and the page asks for it and sends it
in a header. A strict Content-Security-Policy keeps the page to this server's own files.
"""

from __future__ import annotations

import time
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from server.async_engine import AsyncEngine
from server.dashboard.state import ServerInfo, dashboard_state
from server.http.auth import DASHBOARD_STATE_PATH
from server.http.metrics import ServerMetrics

_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def dashboard_router(async_engine: AsyncEngine, metrics: ServerMetrics, served_model_name: str,
                     needs_key: bool) -> APIRouter:
    """The page tells its script whether to ask for a key (`needs_key`) before polling."""
    router = APIRouter(include_in_schema=False)
    info = ServerInfo(served_model_name, async_engine.model_name, async_engine.max_model_len,
                      time.time())  # fmt: skip
    page = _static("dashboard.html").replace(
        "{{NEEDS_KEY}}", "true" if needs_key else "false"
    )

    @router.get("/dashboard")
    async def dashboard_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    @router.get(DASHBOARD_STATE_PATH)
    async def dashboard_state_json() -> JSONResponse:
        state = dashboard_state(async_engine, metrics, info)
        return JSONResponse(state, headers={"Cache-Control": "no-store"})

    for name, media_type in _ASSETS.items():
        router.add_api_route(f"/dashboard/{name}", _asset(name, media_type), methods=["GET"])
    return router


def _asset(name: str, media_type: str):
    body = _static(name)

    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=_PAGE_HEADERS)

    return asset


def _static(name: str) -> str:
    return resources.files("server.dashboard").joinpath("static", name).read_text("utf-8")
