"""One choice's engine outputs as the API shows them, chunk by chunk or whole.

A whole response runs the same per-choice stream over all of a choice's outputs as a
streaming response does one output at a time, so both say the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.core.tool_call_stream import CallPiece
from server.core.turn_parsing import TurnParser
from server.openai.logprobs import LogprobsAligner, TokenEntry, chat_logprobs, completion_logprobs
from server.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatDelta,
    ChatFinishReason,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
)
from server.openai.protocol_tools import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta

if TYPE_CHECKING:
    from metal_engine.outputs import RequestOutput


@dataclass
class ChatPiece:
    """What one output adds to a chat choice."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[CallPiece] = field(default_factory=list)
    logprobs: list[TokenEntry] = field(default_factory=list)
    finish_reason: ChatFinishReason | None = None

    def shown_calls(self) -> list[CallPiece]:
        """The pieces a stream shows: a call's end adds nothing a client sees."""
        return [piece for piece in self.tool_calls if piece.name is not None or piece.arguments]

    def is_empty(self) -> bool:
        return not (
            self.reasoning or self.content or self.shown_calls() or self.logprobs
            or self.finish_reason
        )  # fmt: skip


class ChatChoiceStream:
    """Splits a chat choice into reasoning, content and tool calls (through the model
    format's `parser`), with logprobs."""

    def __init__(
        self,
        parser: TurnParser,
        logprobs: LogprobsAligner | None,
        parallel_calls: bool = True,
    ) -> None:
        self.parser = parser
        self.logprobs = logprobs
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
        entries = self.logprobs.feed(output) if self.logprobs is not None else []
        return ChatPiece(reasoning, content, pieces, entries, finish)

    def _delta(self, piece: CallPiece) -> ToolCallDelta:
        call = self.calls[piece.index]
        first = piece.name is not None
        return ToolCallDelta(
            index=piece.index,
            id=call.id if first else None,
            type="function" if first else None,
            function=FunctionCallDelta(name=piece.name, arguments=piece.arguments),
        )

    def chunk_choice(self, index: int, output: RequestOutput) -> ChatChunkChoice | None:
        """The stream chunk's choice for one output; None when it adds nothing."""
        piece = self.feed(output)
        if piece.is_empty():
            return None
        delta = ChatDelta(
            content=piece.content or None,
            reasoning_content=piece.reasoning or None,
            tool_calls=[self._delta(p) for p in piece.shown_calls()] or None,
        )
        return ChatChunkChoice(
            index=index,
            delta=delta,
            finish_reason=piece.finish_reason,
            logprobs=self._logprobs(piece.logprobs),
        )

    def whole_choice(self, index: int, outputs: list[RequestOutput]) -> ChatChoice:
        pieces = [self.feed(output) for output in outputs]
        calls = self.calls
        content = "".join(p.content for p in pieces)
        reasoning = "".join(p.reasoning for p in pieces)
        message = AssistantMessage(
            content=None if calls and not content.strip() else content,
            reasoning_content=reasoning or None,
            tool_calls=calls or None,
        )
        entries = [entry for piece in pieces for entry in piece.logprobs]
        return ChatChoice(
            index=index,
            message=message,
            finish_reason=pieces[-1].finish_reason,
            logprobs=self._logprobs(entries),
        )

    def _logprobs(self, entries: list[TokenEntry]) -> ChatLogprobs | None:
        return None if self.logprobs is None else ChatLogprobs(content=chat_logprobs(entries))


class CompletionChoiceStream:
    """A completion choice's text (after the echoed prompt, if any), with legacy logprobs."""

    def __init__(self, echo: str, logprobs: LogprobsAligner | None) -> None:
        self._unsent_echo = echo
        self.logprobs = logprobs
        self._logprobs_offset = len(echo)  # where the next logprob entry starts in the text

    def chunk_choice(self, index: int, output: RequestOutput) -> CompletionChoice | None:
        """The stream chunk's choice for one output; None when it adds nothing."""
        text, self._unsent_echo = self._unsent_echo + output.new_text, ""
        entries = self.logprobs.feed(output) if self.logprobs is not None else []
        if not (text or entries or output.finished):
            return None
        return CompletionChoice(
            index=index,
            text=text,
            finish_reason=output.finish_reason,
            logprobs=self._legacy(entries),
        )

    def whole_choice(self, index: int, outputs: list[RequestOutput]) -> CompletionChoice:
        echo = self._unsent_echo
        self._unsent_echo = ""
        entries = []
        if self.logprobs is not None:
            entries = [entry for output in outputs for entry in self.logprobs.feed(output)]
        return CompletionChoice(
            index=index,
            text=echo + "".join(o.new_text for o in outputs),
            finish_reason=outputs[-1].finish_reason,
            logprobs=self._legacy(entries),
        )

    def _legacy(self, entries: list[TokenEntry]) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        legacy = completion_logprobs(entries, self._logprobs_offset)
        self._logprobs_offset += sum(len(e.text) for e in entries)
        return legacy
