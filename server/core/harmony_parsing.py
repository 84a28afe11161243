"""A GPT-OSS turn, token by token, through openai-harmony's StreamableParser: the `analysis`
channel is reasoning, a message to `functions.NAME` is a call of NAME whose arguments stream
as its content, and everything else (the `final` channel, commentary preambles) is content.

    <|channel|>analysis<|message|>Need the weather.<|end|>            reasoning
    <|start|>assistant<|channel|>commentary to=functions.get_weather
        <|constrain|>json<|message|>{"city": "Paris"}<|call|>          call get_weather
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>   content
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from openai_harmony import HarmonyEncoding, HarmonyError, Role, StreamableParser

from server.core.tool_call_stream import CallPiece
from server.core.turn_parsing import TurnPiece

if TYPE_CHECKING:
    from metal_engine.outputs import RequestOutput

FUNCTIONS = "functions."  # the namespace of a request's function tools


class HarmonyTurnParser:
    """A `TurnParser` over the token ids the model generates after `<|start|>assistant`."""

    def __init__(self, encoding: HarmonyEncoding, opened: list[int] | tuple[int, ...] = ()) -> None:
        """`opened`: tokens the prompt already wrote of the turn (a forced call's header);
        what they open comes out with the first output."""
        self.encoding = encoding
        self.parser = StreamableParser(encoding, role=Role.ASSISTANT)
        self.message_ends = frozenset(encoding.stop_tokens())  # <|end|>, <|call|>, <|return|>
        self.message_start = encoding.encode("<|message|>", allowed_special="all")[0]
        self.num_calls = 0  # calls begun so far
        self.arguments: str | None = None  # the open call's arguments so far, if one is open
        self.broken = False  # the tokens left harmony's grammar: the rest is plain content
        self._opened = _PieceBuilder()
        for token in opened:
            self._process(token, self._opened)

    def feed(self, output: RequestOutput) -> TurnPiece:
        piece, self._opened = self._opened, _PieceBuilder()
        for index, token in enumerate(output.new_token_ids):
            if self.broken:
                piece.content += self.encoding.decode(output.new_token_ids[index:])
                break
            self._process(token, piece)
        if output.finished and self.arguments is not None:
            self._end_call(piece)  # the turn ended inside the call (e.g. at max_tokens)
        return piece.build()

    def _process(self, token: int, piece: _PieceBuilder) -> None:
        try:
            self.parser.process(token)
        except HarmonyError:
            # Not harmony (a malformed header, say): shown to the client, not lost.
            self.broken = True
            piece.content += self.encoding.decode([token])
            return
        if token in self.message_ends:
            if self.arguments is not None:
                self._end_call(piece)
            return
        if token == self.message_start:  # the header is complete: its recipient is known
            recipient = self.parser.current_recipient or ""
            if recipient.startswith(FUNCTIONS):
                self.arguments = ""
                piece.calls.append(CallPiece(self.num_calls, recipient[len(FUNCTIONS) :], ""))
            return
        delta = self.parser.last_content_delta
        if not delta:  # a header token, or a character still incomplete
            return
        if self.arguments is not None:
            self.arguments += delta
            piece.add_arguments(self.num_calls, delta)
        elif self.parser.current_channel == "analysis":
            piece.reasoning += delta
        else:
            piece.content += delta

    def _end_call(self, piece: _PieceBuilder) -> None:
        assert self.arguments is not None
        complete = _is_object(self.arguments)
        piece.calls.append(CallPiece(self.num_calls, None, "", done=True, complete=complete))
        self.num_calls += 1
        self.arguments = None


class _PieceBuilder:
    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""
        self.calls: list[CallPiece] = []

    def add_arguments(self, index: int, text: str) -> None:
        """One piece per output for a call's arguments, however many tokens it holds."""
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == index and not last.done:
            self.calls[-1] = CallPiece(index, last.name, last.arguments + text)
        else:
            self.calls.append(CallPiece(index, None, text))

    def build(self) -> TurnPiece:
        return TurnPiece(self.reasoning, self.content, self.calls)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
