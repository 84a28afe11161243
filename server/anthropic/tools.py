"""Which of an Anthropic request's tools the model is told about.

Claude Code sends more tools than it means the model to see at first: deferred tools
(`defer_loading: true`) stay out of the prompt until a `tool_reference` block (in a tool
search's `tool_result`) or a `tool_addition` block (in a `system` message) loads them, as on
Anthropic's API; `tool_removal` takes one out again. Server tools (`web_search_20250305`, ...)
never reach the prompt: Anthropic runs them itself, and nothing here can. Calls the model
makes are parsed whatever their name, so a tool whose schema came as text (Claude Code's
ToolSearch answers with schemas) can still be called.
"""

from __future__ import annotations

from collections.abc import Iterator

from server.anthropic.protocol import ContentBlock, CountTokensRequest, InputMessage, Tool

TOOL_CHANGES = {"tool_addition", "tool_removal"}  # blocks of a `system` message


def offered_tools(body: CountTokensRequest) -> list[Tool]:
    """The client tools the prompt describes, in the order they were given or loaded."""
    known = {tool.name: tool for tool in body.tools}
    offered = {tool.name: tool for tool in body.tools if not tool.defer_loading}
    if body.tool_choice is not None and body.tool_choice.type == "tool":
        _load(offered, known, body.tool_choice.name)  # a forced tool must be described
    for block in _blocks(body.messages):
        if block.type == "tool_reference":
            _load(offered, known, block.tool_name)
        elif block.type in TOOL_CHANGES and block.tool is not None:
            change = block.tool
            if block.type == "tool_removal":
                offered.pop(change.name or "", None)
            elif change.definition is not None:
                known[change.definition.name] = change.definition
                offered[change.definition.name] = change.definition
            else:
                _load(offered, known, change.name)
    return [tool for tool in offered.values() if tool.is_client_tool]


def _load(offered: dict[str, Tool], known: dict[str, Tool], name: str | None) -> None:
    if name in known and name not in offered:
        offered[name] = known[name]


def _blocks(messages: list[InputMessage]) -> Iterator[ContentBlock]:
    """Every block of the conversation, and the blocks inside tool results."""
    for message in messages:
        if isinstance(message.content, str):
            continue
        for block in message.content:
            yield block
            if block.type == "tool_result" and isinstance(block.content, list):
                yield from block.content
