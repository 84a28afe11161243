"""Build an Anthropic `Message` from a turn's events, and the stream events that tell it.

A non-streaming answer is the builder's message once every turn event went in; a stream
sends the events `add` returns as they come. Both see the same blocks:

    message_start
    (content_block_start  content_block_delta*  content_block_stop)*   per thinking/text/tool_use
    message_delta (stop_reason, stop_sequence, usage)  message_stop

A turn cut off inside a tool call (max_tokens) still ends well-formed: the tool_use block is
closed, its `input` whatever the partial JSON holds, and the stop reason is `max_tokens`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from server.anthropic.protocol import (
    AnthropicUsage,
    Message,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from server.core.tool_parsers import partial_json
from server.core.turn_events import (
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Turn,
    TurnEnd,
    TurnEvent,
)
from server.core.turn_http import Event
from server.http.errors import APIError


class MessageBuilder:
    def __init__(self, message_id: str, model: str, turn: Turn) -> None:
        usage = AnthropicUsage.of(turn.prompt_tokens, 0, turn.cached_tokens)
        self.message = Message(id=message_id, model=model, content=[], usage=usage)
        self._open_block: TextBlock | ThinkingBlock | None = None  # still taking deltas
        self._cut_call = False  # a call ended incomplete: the turn made none to run

    def start(self) -> list[Event]:
        return [{"type": "message_start", "message": self.message.model_dump()}]

    def add(self, event: TurnEvent) -> list[Event]:
        if isinstance(event, ReasoningDelta):
            return self._thinking(event.text)
        if isinstance(event, TextDelta):
            return self._text(event.text)
        if isinstance(event, ToolCallStart):
            return self._open_tool_use(event.name)
        if isinstance(event, ToolCallArguments):
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        if isinstance(event, ToolCallEnd):
            return self._close_tool_use(event)
        return self._end(event)

    def fail(self, message: str) -> list[Event]:
        return [APIError(message, status_code=500).anthropic_body()]

    def result(self) -> Message:
        return self.message

    def _thinking(self, text: str) -> list[Event]:
        events = self._continue(ThinkingBlock)
        assert isinstance(self._open_block, ThinkingBlock)
        self._open_block.thinking += text
        return [*events, self._delta({"type": "thinking_delta", "thinking": text})]

    def _text(self, text: str) -> list[Event]:
        events = self._continue(TextBlock)
        assert isinstance(self._open_block, TextBlock)
        self._open_block.text += text
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def _continue(self, kind: type[TextBlock | ThinkingBlock]) -> list[Event]:
        """Keep the open block if it is of `kind`, else close it and open an empty one."""
        if isinstance(self._open_block, kind):
            return []
        events = self._close_open_block()
        self._open_block = kind()
        return [*events, self._open(self._open_block)]

    def _open_tool_use(self, name: str) -> list[Event]:
        """The stream announces the block with empty input; the input follows as JSON text."""
        events = self._close_open_block()
        block = ToolUseBlock(id=f"toolu_{uuid.uuid4().hex[:24]}", name=name, input={})
        return [*events, self._open(block)]

    def _close_tool_use(self, call: ToolCallEnd) -> list[Event]:
        block = self.message.content[-1]
        assert isinstance(block, ToolUseBlock)
        block.input = _input(call)
        self._cut_call = self._cut_call or not call.complete
        return [self._stop()]

    def _end(self, end: TurnEnd) -> list[Event]:
        events = self._close_open_block()
        if not self.message.content:  # clients read content[0]: "nothing" is an empty text
            events += [self._open(TextBlock()), self._stop()]
        self.message.stop_reason = self._stop_reason(end)
        self.message.stop_sequence = end.stop_sequence
        usage = end.usage
        self.message.usage = AnthropicUsage.of(
            usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens
        )
        delta = {"stop_reason": self.message.stop_reason, "stop_sequence": end.stop_sequence}
        return [
            *events,
            {"type": "message_delta", "delta": delta, "usage": self.message.usage.model_dump()},
            {"type": "message_stop"},
        ]

    def _stop_reason(self, end: TurnEnd) -> StopReason:
        calls = any(isinstance(block, ToolUseBlock) for block in self.message.content)
        if calls and not self._cut_call:  # a cut call is not one to run
            return "tool_use"
        if end.finish_reason == "length":
            return "max_tokens"
        return "stop_sequence" if end.stop_sequence is not None else "end_turn"

    def _open(self, block: TextBlock | ThinkingBlock | ToolUseBlock) -> Event:
        self.message.content.append(block)
        shown = block.model_dump()
        return {"type": "content_block_start", "index": self._index, "content_block": shown}

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _stop(self) -> Event:
        return {"type": "content_block_stop", "index": self._index}

    def _close_open_block(self) -> list[Event]:
        if self._open_block is None:
            return []
        self._open_block = None
        return [self._stop()]

    @property
    def _index(self) -> int:
        return len(self.message.content) - 1


def _input(call: ToolCallEnd) -> dict[str, Any]:
    """The call's input: its arguments, or for a call that did not end whole what their
    partial JSON holds (`{}` if nothing)."""
    if call.complete:
        value = json.loads(call.arguments, strict=False)
    else:
        value = partial_json(call.arguments)
    return value if isinstance(value, dict) else {}
