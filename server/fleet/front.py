"""The front door of a server of several models: the guards, the server's own routes, and
every other request sent to the routes of the model it names.

    request ──guards──▶ /health, /metrics, /v1/models, /v1/models/load|unload (here)
                  └────▶ anything else: its `model` (JSON body, else ?model=) → catalog name
                         → fleet.acquire (loading it if need be) → that model's routes

Each model's routes are the one-model server's (server.app.model_app), so every API
behaves as it does with one model. A request that names no model (a dashboard page, a
body without `model`) goes to the default model, else the first loaded one, else the first.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress
from copy import copy
from dataclasses import dataclass
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from metal_engine.loading.parameter_count import ParameterCount
from server.app import HttpOptions, add_guards, model_cards, probes_router
from server.async_engine import AsyncEngine
from server.fleet.cards import unloaded_card
from server.fleet.catalog import ModelCatalog, UnknownModel
from server.fleet.fleet import ModelFleet, ModelUnavailable
from server.http.errors import APIError, install_error_handlers
from server.http.shutdown import Drain
from server.openai.protocol import ModelCard, ModelList


@dataclass(frozen=True)
class ServedModel:
    """A loaded model as the front door uses it: its engine's async front, its routes and
    its parameter counts."""

    bridge: AsyncEngine
    app: FastAPI
    parameters: ParameterCount

    def abort_all(self) -> None:
        self.bridge.abort_all()


class ModelAction(BaseModel):
    model: str


def build_fleet_app(fleet: ModelFleet[ServedModel], options: HttpOptions | None = None,
                    preload: tuple[str, ...] = ()) -> FastAPI:
    """The app of a server of several models. `preload`: the models loaded before it
    serves (pinned ones, the default); any failing to load stops the start."""
    options = options or HttpOptions()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for name in preload:
            await fleet.load(name)
        watcher = asyncio.create_task(fleet.watch_idle())
        yield
        watcher.cancel()
        with suppress(asyncio.CancelledError):
            await watcher
        await fleet.close()

    app = FastAPI(title="metal-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    add_guards(app, options, Drain(fleet))
    app.include_router(_fleet_router(fleet))
    app.router.default = _Dispatch(fleet)  # what no route of the front door matches
    return app


def _fleet_router(fleet: ModelFleet[ServedModel]) -> APIRouter:
    router = probes_router()
    catalog, created = fleet.catalog, int(time.time())

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(_FleetMetrics(fleet)), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=_cards(fleet, created)).model_dump()

    @router.post("/v1/models/load")
    async def load(body: ModelAction) -> dict:
        name = _resolve(catalog, body.model, use_default=False)
        await _unavailable_as_error(fleet.load(name))
        return _card(fleet, name, created).model_dump()

    @router.post("/v1/models/unload")
    async def unload(body: ModelAction) -> dict:
        name = _resolve(catalog, body.model, use_default=False)
        await _unavailable_as_error(fleet.unload(name))
        return _card(fleet, name, created).model_dump()

    return router


def _cards(fleet: ModelFleet[ServedModel], created: int) -> list[ModelCard]:
    loaded = dict(fleet.loaded())
    cards = []
    for status in fleet.status():
        extra = {"state": status.state, "aliases": fleet.catalog.names_of(status.name)[1:]}
        served = loaded.get(status.name)
        if served is None:
            cards.append(unloaded_card(fleet.catalog.entries[status.name], created, **extra))
        else:
            cards += model_cards(served.bridge, [status.name], created, served.parameters,
                                 **extra)
    return cards


def _card(fleet: ModelFleet[ServedModel], name: str, created: int) -> ModelCard:
    return next(card for card in _cards(fleet, created) if card.id == name)


def _resolve(catalog: ModelCatalog, requested: str | None, use_default: bool = True) -> str:
    try:
        return catalog.resolve(requested, use_default)
    except UnknownModel as exc:
        raise APIError(str(exc), status_code=404, param="model", code="model_not_found") from None


async def _unavailable_as_error(work) -> object:
    try:
        return await work
    except ModelUnavailable as exc:
        headers = ({"retry-after": str(int(exc.retry_after_s))}
                   if exc.retry_after_s is not None else None)
        raise APIError(str(exc), status_code=503, param="model", code="model_unavailable",
                       headers=headers) from None


class _Dispatch:
    """Sends a request to the routes of the model it names, that model held loaded (in
    flight) until the response is sent."""

    def __init__(self, fleet: ModelFleet[ServedModel]) -> None:
        self._fleet = fleet

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        messages = await _read_body(receive)
        name = self._model_for(_named_model(scope, messages))
        served = await _unavailable_as_error(self._fleet.acquire(name))
        try:
            await served.app(scope, _replay(messages, receive), send)
        finally:
            self._fleet.release(name)

    def _model_for(self, requested: str | None) -> str:
        catalog = self._fleet.catalog
        if requested is not None:
            with suppress(UnknownModel):
                return catalog.resolve(requested, use_default=False)
            for name, served in self._fleet.loaded():  # an adapter loaded at run time
                if requested in served.bridge.adapters.served():
                    return name
        if requested is not None or catalog.default is not None:
            return _resolve(catalog, requested)
        loaded = self._fleet.loaded()
        return loaded[0][0] if loaded else next(iter(catalog.entries))


async def _read_body(receive: Receive) -> list[Message]:
    """The request's body messages (the guards limit its size and time)."""
    messages = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` for the model's routes: the body read here, then the client's own (a
    disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


def _named_model(scope: Scope, messages: list[Message]) -> str | None:
    """The `model` of a JSON body, else of the query string; None if neither names one."""
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
    if body[:1] == b"{" or body.lstrip()[:1] == b"{":
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            model = None  # the model's routes will say what is wrong with the body
        if isinstance(model, str):
            return model
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model")
    return values[0] if values else None


class _FleetMetrics:
    """`/metrics` of all loaded models (each model's series carry its `model_name`), and
    which models are loaded."""

    def __init__(self, fleet: ModelFleet[ServedModel]) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for _, served in self._fleet.loaded():
            for family in served.app.state.metrics.registry.collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = own = copy(family)
                    own.samples = list(family.samples)
        yield from merged.values()
        loaded = GaugeMetricFamily("metal_serve_model_loaded",
                                   "1 while the model is loaded, else 0.", labels=["model_name"])
        loads = GaugeMetricFamily("metal_serve_model_loads",
                                  "Times the model was loaded since the server started.",
                                  labels=["model_name"])
        for status in self._fleet.status():
            loaded.add_metric([status.name], float(status.state == "loaded"))
            loads.add_metric([status.name], float(status.loads))
        yield loaded
        yield loads
