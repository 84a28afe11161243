"""The FastAPI app: OpenAI-compatible routes over one AsyncEngine."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from server.async_engine import AsyncEngine
from server.errors import install_error_handlers
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.serve_args import DEFAULT_MAX_N
from server.serving import Serving


def build_app(
    async_engine: AsyncEngine, served_model_name: str = "default", max_n: int = DEFAULT_MAX_N
) -> FastAPI:
    """An app serving one model.

    The `model` field of requests is not checked: a single-model server answers whatever
    name the client uses (clients send all sorts). `/v1/models` lists `served_model_name`
    and the model directory's name. A request may ask for up to `max_n` choices.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="metal-serve", lifespan=lifespan)
    install_error_handlers(app)
    serving = Serving(async_engine, served_model_name, max_n)
    created = int(time.time())
    model_ids = list(dict.fromkeys([served_model_name, async_engine.model_name]))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [ModelCard(id=model_id, created=created) for model_id in model_ids]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completion(body, request)

    return app
