"""One choice's engine outputs as the API shows them, chunk by chunk or whole.

A whole response runs the same per-choice stream over all of a choice's outputs as a
streaming response does one output at a time, so both say the same thing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.core.chat_choice import ChatChoiceSplitter, ChatPiece
from server.core.tool_call_stream import CallPiece
from server.core.turn_parsing import TurnParser
from server.openai.logprobs import LogprobsAligner, TokenEntry, chat_logprobs, completion_logprobs
from server.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCallDelta,
    ToolCallDelta,
)

if TYPE_CHECKING:
    from metal_engine.outputs import RequestOutput


class ChatChoiceStream:
    """A chat choice as the chat API shows it: the core's split into reasoning, content and
    tool calls (through the model format's `parser`), with logprobs."""

    def __init__(
        self,
        parser: TurnParser,
        logprobs: LogprobsAligner | None,
        parallel_calls: bool = True,
    ) -> None:
        self.splitter = ChatChoiceSplitter(parser, parallel_calls)
        self.logprobs = logprobs

    def feed(self, output: RequestOutput) -> tuple[ChatPiece, list[TokenEntry]]:
        piece = self.splitter.feed(output)
        entries = self.logprobs.feed(output) if self.logprobs is not None else []
        return piece, entries

    def _delta(self, piece: CallPiece) -> ToolCallDelta:
        call = self.splitter.calls[piece.index]
        first = piece.name is not None
        return ToolCallDelta(
            index=piece.index,
            id=call.id if first else None,
            type="function" if first else None,
            function=FunctionCallDelta(name=piece.name, arguments=piece.arguments),
        )

    def chunk_choice(self, index: int, output: RequestOutput) -> ChatChunkChoice | None:
        """The stream chunk's choice for one output; None when it adds nothing."""
        piece, entries = self.feed(output)
        if piece.is_empty() and not entries:
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
            logprobs=self._logprobs(entries),
        )

    def whole_choice(self, index: int, outputs: list[RequestOutput]) -> ChatChoice:
        fed = [self.feed(output) for output in outputs]
        pieces = [piece for piece, _ in fed]
        calls = self.splitter.calls
        content = "".join(p.content for p in pieces)
        reasoning = "".join(p.reasoning for p in pieces)
        message = AssistantMessage(
            content=None if calls and not content.strip() else content,
            reasoning_content=reasoning or None,
            tool_calls=calls or None,
        )
        entries = [entry for _, piece_entries in fed for entry in piece_entries]
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
