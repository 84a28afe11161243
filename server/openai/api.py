"""The OpenAI chat and completions routes: `POST /v1/chat/completions`, `POST /v1/completions`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.core.chat_request import ChatCompletionRequest
from server.http.limits import check_priority, check_request_limits
from server.openai.protocol import CompletionRequest
from server.openai.serving import Serving


def openai_router(serving: Serving, min_priority: int = 0) -> APIRouter:
    """The routes; a request's `priority` may not be below `min_priority`."""
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_request_limits(body)
        check_priority(body.priority, min_priority)
        return await serving.chat(body, request)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_request_limits(body)
        check_priority(body.priority, min_priority)
        return await serving.completion(body, request)

    return router
