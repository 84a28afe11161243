"""The OpenAI Responses API, stateless: `POST /v1/responses`.

Nothing is stored, so each request carries its whole conversation in `input`; the fields
that refer to stored responses get a 400 naming them. Requests as Codex sends them (namespace,
custom and built-in tools, reasoning sent back, no `max_output_tokens`) are served as they are.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.requests import Request

from server.async_engine import AsyncEngine
from server.core import assistant_turn
from server.core.turn_serving import serve_turn
from server.responses.input import RESPONSES_PARAMS, chat_request
from server.responses.output import ResponseBuilder
from server.responses.protocol import ResponseObject, ResponsesRequest
from server.responses.tools import read_tools


def responses_router(
    engine: AsyncEngine, model_name: str, tool_call_parser: str | None = None
) -> APIRouter:
    """Routes answering as `model_name`; `tool_call_parser` overrides the template's parser."""
    router = APIRouter()

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        response_id = f"resp_{uuid.uuid4().hex}"
        tools = read_tools(body.tools)
        chat = chat_request(body, tools)
        in_progress = _in_progress(body, response_id, model_name)
        start = assistant_turn.start(engine, chat, response_id, tool_call_parser, RESPONSES_PARAMS)
        builder = ResponseBuilder(in_progress, tools)
        return await serve_turn(request, start, lambda _: builder, body.stream)

    return router


def _in_progress(body: ResponsesRequest, response_id: str, model_name: str) -> ResponseObject:
    """The response before any output, echoing the request's settings as the API does."""
    return ResponseObject(
        id=response_id,
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=model_name,
        parallel_tool_calls=body.parallel_tool_calls,
        temperature=body.temperature,
        text=body.text,
        tool_choice=body.tool_choice,
        tools=body.tools,
        top_p=body.top_p,
        metadata=body.metadata or {},
    )
