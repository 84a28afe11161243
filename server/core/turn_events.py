"""One assistant turn of a chat request, for the APIs that speak in items and blocks
(Responses, Anthropic Messages). The chat path's pieces render the prompt, constrain and
parse tool calls; the turn comes back as plain events that each API turns into its own
output object and stream.

    ChatCompletionRequest ─start─▶ Turn.events: (ReasoningDelta | TextDelta | call)* TurnEnd
    call = ToolCallStart ToolCallArguments* ToolCallEnd     (one call open at a time)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from metal_engine.outputs import RequestOutput
from scheduler.request import FinishReason
from server.async_engine import AsyncEngine, EngineError
from server.core import engine_choices
from server.core.chat_choice import ChatChoiceSplitter
from server.core.chat_format import prepared_chat
from server.core.chat_request import ChatCompletionRequest, Usage
from server.core.prompt_ids import check_context
from server.core.tool_call_stream import CallPiece
from server.http.errors import APIError


@dataclass(frozen=True)
class ReasoningDelta:
    text: str  # from a reasoning model's `<think>` block


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    name: str  # a call begins; its arguments follow as they are generated


@dataclass(frozen=True)
class ToolCallArguments:
    text: str  # the next fragment of the open call's arguments (JSON text)


@dataclass(frozen=True)
class ToolCallEnd:
    """The open call ended: `arguments` is its fragments joined. `complete` says they are a
    whole JSON object; else the turn ended inside the call, or the call was malformed, and
    they are what was written (not a call to run)."""

    name: str
    arguments: str
    complete: bool = True


@dataclass(frozen=True)
class TurnEnd:
    finish_reason: FinishReason
    stop_sequence: str | None  # the request's stop string that ended the turn, if one did
    usage: Usage


TurnEvent = ReasoningDelta | TextDelta | ToolCallStart | ToolCallArguments | ToolCallEnd | TurnEnd


@dataclass(frozen=True)
class Turn:
    """A turn the engine accepted: its events, read from the engine's `choices`."""

    prompt_tokens: int
    cached_tokens: int
    events: AsyncGenerator[TurnEvent, None]
    choices: engine_choices.Choices

    async def aclose(self) -> None:
        """Abort the request if it still runs. `choices` is closed too, in case `events`
        never started (its body, which closes them, then never runs)."""
        await self.events.aclose()
        await self.choices.aclose()


def validated_chat_request(
    fields: dict[str, Any], param_names: dict[str, str] | None = None,
    image_fields: list[str] | None = None,
) -> ChatCompletionRequest:
    """The chat request from translated `fields`; a 400 names the caller's field, through
    `param_names` (chat field -> the API's own name), and so does an error of loading an
    image, through `image_fields` (the caller's field of each image part, in order)."""
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        chat_field = str(error["loc"][0]) if error["loc"] else None
        param = (param_names or {}).get(chat_field, chat_field) if chat_field else None
        message = str(error["msg"]).removeprefix("Value error, ")
        raise APIError(f"Invalid request: {param or 'body'}: {message}", param=param) from exc
    if image_fields is not None:
        chat.name_images(image_fields)
    return chat


async def start(
    engine: AsyncEngine,
    chat: ChatCompletionRequest,
    request_id: str,
    parser_name: str | None,
    param_names: dict[str, str] | None = None,
) -> Turn:
    """Render and submit the turn (served by the LoRA adapter its `model` names, if any),
    and wait for its first output, so that a refusal is still a 400; its `param` is renamed
    through `param_names` to the caller's field."""
    names = param_names or {}
    try:
        prepared = await prepared_chat(engine, chat, parser_name, engine.max_prompt_bytes)
        max_tokens = check_context(
            len(prepared.ids),
            engine.sampling_defaults.max_tokens(chat.requested_max_tokens()),
            engine.max_model_len,
            names.get("messages", "messages"),
        )
        params = prepared.sampling_params(chat, max_tokens, engine.sampling_defaults)
        choices = await engine_choices.start(
            engine, prepared.ids, params, request_id, cache_salt=chat.cache_salt,
            media=prepared.media, lora_name=engine.adapters.lora_name(chat.model),
        )
    except APIError as exc:
        exc.param = names.get(exc.param or "", exc.param)
        raise
    try:
        _, first = await anext(choices)  # at hand: `engine_choices.start` waited for it
    except BaseException:  # e.g. the client left: stop the request
        await choices.aclose()
        raise
    # The chat path's splitter into reasoning, content and tool calls (never raw call syntax).
    splitter = ChatChoiceSplitter(prepared.new_parser(), chat.parallel_tool_calls)
    events = _events(first, choices, splitter)
    return Turn(first.num_prompt_tokens, first.num_cached_tokens, events, choices)


async def _events(
    first: RequestOutput, choices: engine_choices.Choices, splitter: ChatChoiceSplitter
) -> AsyncGenerator[TurnEvent, None]:
    async with contextlib.aclosing(choices):
        output = first
        while True:
            piece = splitter.feed(output)
            if piece.reasoning:
                yield ReasoningDelta(piece.reasoning)
            if piece.content:
                yield TextDelta(piece.content)
            for event in _call_events(piece.tool_calls, splitter):
                yield event
            if output.finished:
                break
            _, output = await anext(choices)
    reason = output.finish_reason or "abort"
    yield TurnEnd(reason, output.stop_string, engine_choices.usage_of([output]))


def _call_events(calls: list[CallPiece], splitter: ChatChoiceSplitter) -> list[TurnEvent]:
    events: list[TurnEvent] = []
    for call in calls:
        if call.name is not None:
            events.append(ToolCallStart(call.name))
        if call.arguments:
            events.append(ToolCallArguments(call.arguments))
        if call.done:
            function = splitter.calls[call.index].function
            events.append(ToolCallEnd(function.name, function.arguments, call.complete))
    return events


async def consume(turn: Turn, on_event: Callable[[TurnEvent], object]) -> None:
    """Run the whole turn through `on_event`, for non-streaming responses (an engine
    failure becomes a 500)."""
    try:
        async with contextlib.aclosing(turn):
            async for event in turn.events:
                on_event(event)
    except EngineError as exc:
        raise engine_choices.engine_failure(exc) from exc
