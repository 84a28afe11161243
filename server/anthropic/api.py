"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Errors on these paths get Anthropic's error body (see `server.http.errors`), also mid-stream.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.requests import Request

from server.anthropic.input import chat_request
from server.anthropic.output import MessageBuilder
from server.anthropic.protocol import CountTokensRequest, MessagesRequest, TokenCount
from server.async_engine import AsyncEngine
from server.core import turn_events
from server.core.chat_format import prepared_chat
from server.core.turn_http import serve_turn
from server.http.limits import check_request_limits


def anthropic_router(
    engine: AsyncEngine, model_name: str, tool_call_parser: str | None = None
) -> APIRouter:
    """Routes answering as `model_name` (or as the LoRA adapter a request names);
    `tool_call_parser` overrides the template's parser."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        check_request_limits(body)
        message_id = f"msg_{uuid.uuid4().hex}"
        start = turn_events.start(engine, chat_request(body), message_id, tool_call_parser)
        answering = engine.adapters.lora_name(body.model) or model_name
        return await serve_turn(
            request, start, lambda turn: MessageBuilder(message_id, answering, turn), body.stream
        )

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        """The prompt tokens a /v1/messages call with these fields reports."""
        check_request_limits(body)  # the same caps: counting renders every tool too
        chat = chat_request(body)
        # Counted in full whatever its length (no context to fit): clients size conversations
        # past the context with it. Long ones take the prompt worker's long lane.
        prepared = await prepared_chat(engine, chat, tool_call_parser, None)
        return TokenCount(input_tokens=len(prepared.ids)).model_dump()

    return router
