"""One chat choice, output by output: the turn parser's reasoning, content and call pieces, the
calls so far as `ToolCall`s (ids given, arguments joined as they stream), and the finish
reason a chat answer reports ("tool_calls" once a whole call ended the turn).

The chat API's choice streams (server.openai.choice_streams) and the turn events of the
Responses and Anthropic APIs (turn_events.py) both read a choice through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.core.chat_request import ChatFinishReason
from server.core.chat_request_tools import FunctionCall, ToolCall
from server.core.tool_call_stream import CallPiece
from server.core.turn_parsing import TurnParser

if TYPE_CHECKING:
    from metal_engine.outputs import RequestOutput


@dataclass
class ChatPiece:
    """What one output adds to a chat choice."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[CallPiece] = field(default_factory=list)
    finish_reason: ChatFinishReason | None = None

    def shown_calls(self) -> list[CallPiece]:
        """The pieces a stream shows: a call's end adds nothing a client sees."""
        return [piece for piece in self.tool_calls if piece.name is not None or piece.arguments]

    def is_empty(self) -> bool:
        return not (self.reasoning or self.content or self.shown_calls() or self.finish_reason)


class ChatChoiceSplitter:
    """Splits a chat choice into reasoning, content and tool calls (through the model
    format's `parser`); without `parallel_calls`, calls after the first are dropped."""

    def __init__(self, parser: TurnParser, parallel_calls: bool = True) -> None:
        self.parser = parser
        self.parallel_calls = parallel_calls
        self.calls: list[ToolCall] = []  # the calls so far, their arguments as streamed
        self.num_complete = 0  # calls that ended whole (not cut by the end of the text)

    def feed(self, output: RequestOutput) -> ChatPiece:
        turn = self.parser.feed(output)
        reasoning, content, pieces = turn.reasoning, turn.content, turn.calls
        if not self.parallel_calls:
            pieces = [piece for piece in pieces if piece.index == 0]
        for piece in pieces:
            if piece.name is not None:
                self.calls.append(ToolCall(function=FunctionCall(name=piece.name, arguments="")))
            self.calls[piece.index].function.arguments += piece.arguments
            self.num_complete += piece.done and piece.complete
        finish: ChatFinishReason | None = output.finish_reason
        if finish == "stop" and self.num_complete:
            finish = "tool_calls"
        return ChatPiece(reasoning, content, pieces, finish)
