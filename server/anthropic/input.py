"""Translate an Anthropic Messages request into the chat-completions request it means.

The chat path then renders the prompt (tools included), constrains tool calls and parses
them, so both APIs share one behaviour. The translation is lenient where clients are sloppy
(`system` messages inside `messages` join the system prompt) and refuses what it cannot
render (images, documents, server tools) with a message naming the block.
"""

from __future__ import annotations

import json
from typing import Any

from server.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    InputMessage,
    MessagesRequest,
    ToolChoice,
)
from server.core.assistant_turn import validated_chat_request
from server.http.errors import APIError
from server.openai.protocol import ChatCompletionRequest

# Earlier turns' reasoning: Anthropic itself leaves it out of the context, and so do we.
_DROPPED_BLOCKS = {"thinking", "redacted_thinking"}
# Separate text blocks are separate paragraphs (e.g. a reminder block, then the question).
_BLOCK_SEPARATOR = "\n\n"


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request for `body`; a `MessagesRequest` also brings its sampling fields."""
    fields: dict[str, Any] = {"messages": _system(body) + _conversation(body.messages)}
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in body.tools
        ]
        if body.tool_choice is not None:
            fields["tool_choice"] = _tool_choice(body.tool_choice)
            fields["parallel_tool_calls"] = not body.tool_choice.disable_parallel_tool_use
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences,
        )
    return validated_chat_request(fields)


def _tool_choice(choice: ToolChoice) -> str | dict:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _system(body: CountTokensRequest) -> list[dict]:
    """One system message: `system`, then any system messages found among `messages`."""
    parts = []
    if body.system:
        parts.append(_text(body.system, "system"))
    for index, message in enumerate(body.messages):
        if message.role == "system":
            parts.append(_text(message.content, f"messages[{index}]"))
    return [{"role": "system", "content": _BLOCK_SEPARATOR.join(parts)}] if parts else []


def _conversation(messages: list[InputMessage]) -> list[dict]:
    chat: list[dict] = []
    turns = [(i, m) for i, m in enumerate(messages) if m.role != "system"]
    if not turns:
        raise APIError("messages holds no user or assistant message.")
    last_index, last = turns[-1]
    if last.role == "assistant":
        raise APIError(
            f"messages[{last_index}]: the conversation ends with an assistant message; "
            "continuing a prefilled reply is not supported, end with a user message."
        )
    for index, message in turns:
        where = f"messages[{index}]"
        if message.role == "assistant":
            chat.append(_assistant(message.content, where))
        else:
            chat.extend(_user(message.content, where))
    return chat


def _assistant(content: str | list[ContentBlock], where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls = [], []
    for block in content:
        if block.type == "text":
            texts.append(_block_text(block, where))
        elif block.type == "tool_use":
            if block.id is None or block.name is None or block.input is None:
                raise APIError(f"{where}: a tool_use block needs id, name and input.")
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif block.type not in _DROPPED_BLOCKS:
            raise _unsupported(block, where, "text and tool_use")
    message: dict[str, Any] = {"role": "assistant", "content": _BLOCK_SEPARATOR.join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(content: str | list[ContentBlock], where: str) -> list[dict]:
    """Tool results become tool messages; text between them becomes user messages."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    messages: list[dict] = []
    texts: list[str] = []
    for block in content:
        if block.type == "text":
            texts.append(_block_text(block, where))
            continue
        if block.type != "tool_result":
            raise _unsupported(block, where, "text and tool_result")
        if texts:
            messages.append({"role": "user", "content": _BLOCK_SEPARATOR.join(texts)})
            texts = []
        messages.append(_tool_result(block, where))
    if texts:
        messages.append({"role": "user", "content": _BLOCK_SEPARATOR.join(texts)})
    return messages


def _tool_result(block: ContentBlock, where: str) -> dict:
    if block.tool_use_id is None:
        raise APIError(f"{where}: a tool_result block needs its tool_use_id.")
    text = _text(block.content or "", f"{where} tool_result")
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _text(content: str | list[ContentBlock], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if block.type != "text":
            raise _unsupported(block, where, "text")
        texts.append(_block_text(block, where))
    return _BLOCK_SEPARATOR.join(texts)


def _block_text(block: ContentBlock, where: str) -> str:
    if block.text is None:
        raise APIError(f"{where}: a text block has no 'text' field.")
    return block.text


def _unsupported(block: ContentBlock, where: str, supported: str) -> APIError:
    return APIError(
        f"{where}: content blocks of type {block.type!r} are not supported here; "
        f"send {supported} blocks."
    )
