"""The FastAPI app: OpenAI-compatible routes over one AsyncEngine, behind the guards that
`HttpOptions` configures."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from server.anthropic.api import anthropic_router
from server.async_engine import AsyncEngine
from server.core.chat_format import load_chat_format
from server.core.tool_plan import takes_tools
from server.dashboard.routes import dashboard_router
from server.http.auth import ApiKeyAuth
from server.http.body_limit import RequestBody
from server.http.client_timeouts import ResponseDeadline
from server.http.errors import install_error_handlers
from server.http.host_check import HostCheck
from server.http.logs import RequestIdMiddleware
from server.http.metrics import ServerMetrics
from server.http.shutdown import Drain, DrainGate
from server.openai.api import openai_router
from server.openai.lora_api import lora_router
from server.openai.pooling_api import pooling_router
from server.openai.protocol import ModelCard, ModelList
from server.openai.render import render_router
from server.openai.serving import Serving
from server.responses.api import responses_router
from server.serve_args import (
    DEFAULT_CLIENT_TIMEOUT_S,
    DEFAULT_MAX_N,
    DEFAULT_MAX_REQUEST_BODY,
    PREFIX_CACHE_SCOPES,
    PrefixCacheScope,
)

if TYPE_CHECKING:
    from metal_engine.loading.parameter_count import ParameterCount


@dataclass(frozen=True)
class HttpOptions:
    """What the HTTP layer enforces before a request reaches a route.

    `api_keys`: any of them opens `/v1/*`; none leaves it open. `prefix_cache_scope`: "key"
    keeps each key's prefix cache to itself, "shared" lets all keys reuse each other's (and
    learn from `cached_tokens` what the others sent). `allowed_origins`: browser origins that
    may call the API (CORS); empty sends no CORS headers at all, "*" allows any.
    `max_request_body`: bytes.
    `allowed_hosts`: the Host names requests may use (None: any; see
    `server.http.host_check.allowed_hosts`). `client_timeout_s`: see
    `server.http.client_timeouts`. `min_priority`: the lowest `priority` a request may ask for.
    """

    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_request_body: int = DEFAULT_MAX_REQUEST_BODY
    allowed_hosts: frozenset[str] | None = None
    client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S
    min_priority: int = 0
    prefix_cache_scope: PrefixCacheScope = "key"

    def __post_init__(self) -> None:
        if any(not key.strip() for key in self.api_keys):
            raise ValueError(
                "an API key is empty; give --api-key non-empty keys (comma-separated) or omit it"
            )
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(
                f"prefix_cache_scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}, got "
                f"{self.prefix_cache_scope!r}"
            )
        if self.max_request_body < 1:
            raise ValueError(f"max_request_body must be positive, got {self.max_request_body}")


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str = "default",
    max_n: int = DEFAULT_MAX_N,
    options: HttpOptions | None = None,
    tool_call_parser: str | None = None,
    parameters: ParameterCount | None = None,
) -> FastAPI:
    """An app serving one model: `model_app`'s routes behind the guards `options` set up,
    running `async_engine` for the app's lifetime. `app.state.drain` is what a graceful
    shutdown drains."""
    options = options or HttpOptions()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        async_engine.shutdown()

    app = model_app(async_engine, served_model_name, max_n, tool_call_parser, parameters,
                    min_priority=options.min_priority, needs_key=bool(options.api_keys),
                    lifespan=lifespan)
    add_guards(app, options, Drain(async_engine))
    return app


def model_app(
    async_engine: AsyncEngine,
    served_model_name: str = "default",
    max_n: int = DEFAULT_MAX_N,
    tool_call_parser: str | None = None,
    parameters: ParameterCount | None = None,
    *,
    min_priority: int = 0,
    needs_key: bool = False,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """One model's routes, without guards: the whole app of a one-model server (`build_app`
    adds the guards), or one model of several behind `server.fleet.front`.

    The `model` field of requests is not checked here: a single-model server answers whatever
    name the client uses (clients send all sorts), except that the name of a loaded LoRA
    adapter picks that adapter (docs/lora.md). `/v1/models` lists `served_model_name`
    and the model directory's name, each with its context length and the sampling defaults
    of requests (`async_engine.sampling_defaults`), then each adapter, its `parent` the first.
    A request may ask for up to `max_n` choices, and a `priority` no lower than
    `min_priority`. `tool_call_parser` names the tool-call format (default: picked from the
    chat template).
    `parameters`, when given, are listed on the model cards (total and active per token).
    `/dashboard` shows what the server is doing (server.dashboard); `needs_key` tells its page
    that the API asks for a key. `app.state.metrics` is the model's `/metrics` registry.
    """
    load_chat_format(async_engine.tokenizer)
    # No /docs or /redoc: their pages load scripts from a CDN into this server's origin.
    app = FastAPI(title="metal-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    metrics = ServerMetrics(async_engine.stats, served_model_name, async_engine.prompts_waiting)
    app.state.metrics = metrics
    async_engine.observe_requests(metrics.request)
    serving = Serving(async_engine, served_model_name, max_n, tool_call_parser)
    model_ids = list(dict.fromkeys([served_model_name, async_engine.model_name]))
    parser = serving.tool_call_parser
    app.include_router(_service_router(async_engine, metrics, model_ids, parameters))
    app.include_router(dashboard_router(async_engine, metrics, served_model_name,
                                        needs_key=needs_key))
    app.include_router(openai_router(serving, min_priority))
    app.include_router(pooling_router(async_engine, served_model_name))
    app.include_router(lora_router(async_engine, model_ids))
    app.include_router(render_router(async_engine, parser))
    app.include_router(responses_router(async_engine, served_model_name, parser))
    app.include_router(anthropic_router(async_engine, served_model_name, parser))
    return app


def _service_router(
    async_engine: AsyncEngine, metrics: ServerMetrics, model_ids: list[str],
    parameters: ParameterCount | None = None,
) -> APIRouter:
    """`/health`, `/metrics` and `/v1/models`."""
    router = probes_router()
    created = int(time.time())

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @router.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=model_cards(async_engine, model_ids, created, parameters)
                         ).model_dump()

    return router


def probes_router() -> APIRouter:
    """`/health`, and Claude Code's reachability probe (`HEAD /api/hello`) before each run."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @router.api_route("/api/hello", methods=["GET", "HEAD"])
    async def hello() -> Response:
        return Response(status_code=200)

    return router


def model_cards(async_engine: AsyncEngine, model_ids: list[str], created: int,
                parameters: ParameterCount | None = None, **extra: object) -> list[ModelCard]:
    """A loaded model's cards: one per id in `model_ids`, then one per LoRA adapter (its
    `parent` the first id); `extra`: more card fields for all of them."""
    counts = ({"num_parameters": parameters.total, "active_parameters": parameters.active}
              if parameters else {})
    common = dict(created=created, max_model_len=async_engine.max_model_len,
                  sampling_defaults=asdict(async_engine.sampling_defaults),
                  capabilities=_capabilities(async_engine), **extra)
    cards = [ModelCard(id=model_id, **common, **counts) for model_id in model_ids]
    cards += [ModelCard(id=name, **common, parent=model_ids[0], root=path)
              for name, path in async_engine.adapters.served().items()]
    return cards


def _capabilities(async_engine: AsyncEngine) -> list[str]:
    """What the model serves: "completion", "chat" (a chat template) and "tools" (a template
    that takes them) if it generates, "vision" if it reads images, "embeddings" or "rerank"
    if it pools."""
    runner = getattr(async_engine.engine, "runner", None)
    pooling = getattr(async_engine.engine, "pooling", None)
    generates = runner is None or (runner.model.has_head and pooling is None)
    capabilities = ["completion"] if generates else []
    template = getattr(async_engine.tokenizer, "chat_template", None) if generates else None
    if template:
        capabilities += ["chat", "tools"] if takes_tools(str(template)) else ["chat"]
    if async_engine.vision:
        capabilities.append("vision")
    if pooling is not None:
        capabilities.append("embeddings" if pooling.task == "embed" else "rerank")
    return capabilities


def add_guards(app: FastAPI, options: HttpOptions, drain: Drain) -> None:
    """Outermost first: request id → response deadline → Host check → drain gate → CORS →
    API key → request body → routes. CORS sits outside the key check so that preflights pass and
    a 401 still carries CORS headers."""
    app.state.drain = drain
    app.add_middleware(
        RequestBody, max_bytes=options.max_request_body, timeout_s=options.client_timeout_s
    )
    if options.api_keys:
        shared = options.prefix_cache_scope == "shared"
        app.add_middleware(ApiKeyAuth, api_keys=options.api_keys, share_prefix_cache=shared)
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(options.allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["*"],  # the SDKs send many of their own (x-stainless-*, ...)
            expose_headers=["x-request-id", "retry-after"],
        )  # fmt: skip
    app.add_middleware(DrainGate, drain=drain)
    if options.allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=options.allowed_hosts)
    app.add_middleware(ResponseDeadline, timeout_s=options.client_timeout_s)
    app.add_middleware(RequestIdMiddleware)
