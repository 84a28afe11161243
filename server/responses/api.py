"""The OpenAI Responses API: `POST /v1/responses`, and `GET` / `DELETE /v1/responses/{id}`
for the responses kept in memory (server.responses.store, one store per app); and vLLM's
`POST /v1/responses/render`, a request's prompt token ids (see server.openai.render).

A request is served on its `input`, after the stored conversation that `previous_response_id`
names. Requests as Codex sends them (namespace, custom and built-in tools, reasoning sent
back, no `max_output_tokens`, `store: false`) are served as they are. An id the caller's key
did not store (or that was evicted or deleted) is unknown, as OpenAI's API answers it: a 404
on GET and DELETE, a 400 `previous_response_not_found` on POST.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.requests import Request

from server.async_engine import AsyncEngine
from server.core import turn_events
from server.core.chat_format import render_ids
from server.core.turn_http import serve_turn
from server.http.errors import APIError
from server.http.limits import check_request_limits
from server.http.tenants import current_caller
from server.responses.input import RESPONSES_PARAMS, chat_request
from server.responses.output import ResponseBuilder
from server.responses.protocol import ResponseObject, ResponsesRequest
from server.responses.store import STORE_BY_DEFAULT, ResponseStore, StoredResponse, as_input
from server.responses.tools import read_tools


def responses_router(
    engine: AsyncEngine, model_name: str, tool_call_parser: str | None = None
) -> APIRouter:
    """Routes answering as `model_name` (or as the LoRA adapter a request names);
    `tool_call_parser` overrides the template's parser.
    Each API key owns its stored responses apart (`current_caller`; one owner without keys)."""
    router = APIRouter()
    store = ResponseStore()

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        owner = current_caller()
        previous = _previous(store, owner, body.previous_response_id)
        response_id = f"resp_{uuid.uuid4().hex}"
        tools = read_tools(body.tools)
        chat = chat_request(body, tools, previous.conversation if previous else ())
        answering = engine.adapters.lora_name(body.model) or model_name
        in_progress = _in_progress(body, response_id, answering)
        start = turn_events.start(engine, chat, response_id, tool_call_parser, RESPONSES_PARAMS)
        on_end = _storing(store, owner, body, previous) if in_progress.store else None
        builder = ResponseBuilder(in_progress, tools, on_end)
        return await serve_turn(request, start, lambda _: builder, body.stream)

    @router.post("/v1/responses/render")
    async def render_response(body: ResponsesRequest) -> dict:
        chat = chat_request(body, read_tools(body.tools))
        check_request_limits(chat)
        return {"token_ids": await render_ids(engine, chat, tool_call_parser)}

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False) -> dict:
        if stream:
            raise APIError(
                "stream is not supported here: a stored response is complete; get it without "
                "stream.",
                param="stream",
            )
        entry = store.get(current_caller(), response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        if not store.delete(current_caller(), response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


def _previous(
    store: ResponseStore, owner: str | None, response_id: str | None
) -> StoredResponse | None:
    if response_id is None:
        return None
    entry = store.get(owner, response_id)
    if entry is None:
        raise APIError(
            f"Previous response with id '{response_id}' not found. Only responses created with "
            "store (the default) by the same API key are kept, in memory, until evicted.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return entry


def _not_found(response_id: str) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", status_code=404)


def _storing(
    store: ResponseStore, owner: str | None, body: ResponsesRequest,
    previous: StoredResponse | None,
) -> Callable[[ResponseObject], None]:
    """What stores the response once it ended: with the conversation that led to it, its
    input and its output."""

    def on_end(response: ResponseObject) -> None:
        outputs = [as_input(item) for item in response.output]
        store.put(owner, response.model_dump(), previous, [*body.input_items(), *outputs])

    return on_end


def _in_progress(body: ResponsesRequest, response_id: str, model_name: str) -> ResponseObject:
    """The response before any output, echoing the request's settings as the API does."""
    return ResponseObject(
        id=response_id,
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=model_name,
        parallel_tool_calls=body.parallel_tool_calls,
        previous_response_id=body.previous_response_id,
        store=STORE_BY_DEFAULT if body.store is None else body.store,
        temperature=body.temperature,
        text=body.text,
        tool_choice=body.tool_choice,
        tools=body.tools,
        top_p=body.top_p,
        metadata=body.metadata or {},
    )
