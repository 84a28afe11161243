"""The interface that splits an assistant turn, output by output, into reasoning, content
and tool calls: one implementation reads the text a chat template's model writes
(`<think>` blocks, a family's tool-call syntax), another harmony's messages (harmony_parsing).

    RequestOutput ─feed─▶ TurnPiece(reasoning, content, calls: CallPiece*)

Every API (chat completions, Responses, Anthropic Messages) builds on these pieces, so a
format is added once, here, and not per API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from server.core.reasoning import ReasoningStream
from server.core.tool_call_stream import CallPiece, ToolCallStream

if TYPE_CHECKING:
    from metal_engine.outputs import RequestOutput


@dataclass(frozen=True)
class TurnPiece:
    """What one output adds to the turn. Calls are numbered from 0 in the order they begin;
    a call's pieces come in order, its name on the first, `done` on the last."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)


class TurnParser(Protocol):
    """Splits one choice's outputs. Stateful: one parser per choice, fed every output in
    order; the last one (`output.finished`) ends whatever is still open."""

    def feed(self, output: RequestOutput) -> TurnPiece: ...


class TemplateTurnParser:
    """The text of a chat template's model: a leading `<think>` block is reasoning, the
    family's tool-call syntax (when tools were offered) becomes calls, the rest content."""

    def __init__(self, reasoning: ReasoningStream, tools: ToolCallStream | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, output: RequestOutput) -> TurnPiece:
        final = output.finished
        reasoning, content = self.reasoning.feed(output.new_text, final)
        if self.tools is None:
            return TurnPiece(reasoning, content)
        content, calls = self.tools.feed(content, final)
        return TurnPiece(reasoning, content, calls)
