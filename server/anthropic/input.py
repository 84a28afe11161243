"""Translate an Anthropic Messages request into the chat-completions request it means.

The chat path then renders the prompt (tools included), constrains tool calls and parses
them, so both APIs share one behaviour. The translation is lenient where clients are sloppy
(`system` messages inside `messages` join the system prompt) and refuses what it cannot
render (documents) with a message naming the message and block, `messages[i].content[j]`.
Image blocks (in a `tool_result` too) become the chat's image parts, named by their
`source` for the errors of loading them (server.core.chat_images).
"""

from __future__ import annotations

import json
from typing import Any

from server.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    InputMessage,
    MessagesRequest,
    Tool,
    ToolChoice,
)
from server.anthropic.tools import TOOL_CHANGES, offered_tools
from server.core.chat_request import ChatCompletionRequest
from server.core.turn_events import validated_chat_request
from server.http.errors import APIError

# Earlier turns' reasoning: Anthropic itself leaves it out of the context, and so do we.
_DROPPED_BLOCKS = {"thinking", "redacted_thinking"}
# Separate text blocks are separate paragraphs (e.g. a reminder block, then the question).
_BLOCK_SEPARATOR = "\n\n"
# Claude Code's first system block is for Anthropic's billing, not the model; it changes with
# every Claude Code version (and would start the prompt with tokens no cache has seen).
_BILLING_HEADER = "x-anthropic-billing-header:"


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request for `body`; a `MessagesRequest` also brings its sampling fields."""
    image_fields: list[str] = []
    messages = _system(body) + _conversation(body.messages, image_fields)
    fields: dict[str, Any] = {"messages": messages, "model": body.model}
    tools = offered_tools(body)
    choice = body.tool_choice
    chat_choice = _tool_choice(choice, body, tools) if choice is not None else None
    if tools:
        fields["tools"] = [_function(tool) for tool in tools]
        if chat_choice is not None:
            fields["tool_choice"] = chat_choice
        if choice is not None:
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences,
        )
    return validated_chat_request(fields, image_fields=image_fields)


def _function(tool: Tool) -> dict:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    return {"type": "function", "function": function}


def _tool_choice(
    choice: ToolChoice, body: CountTokensRequest, offered: list[Tool]
) -> str | dict | None:
    """The chat `tool_choice`; None (auto) for one naming a server tool, which nothing here
    runs. Any other name must be an offered tool: a 400, not a silent auto, for a typo."""
    if choice.type != "tool":
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.name in {tool.name for tool in offered}:
        return {"type": "function", "function": {"name": choice.name}}
    if choice.name in {tool.name for tool in body.tools if not tool.is_client_tool}:
        return None
    raise APIError(
        f"tool_choice names {choice.name!r}, which is not a tool offered to the model: "
        "name one in tools (and not taken out by a tool_removal).",
        param="tool_choice",
    )


def _system(body: CountTokensRequest) -> list[dict]:
    """One system message: `system`, then any system messages found among `messages`."""
    parts = [_system_field(body.system)]
    for index, message in enumerate(body.messages):
        if message.role == "system":
            parts.append(_system_message(message.content, f"messages[{index}]"))
    parts = [part for part in parts if part]
    return [{"role": "system", "content": _BLOCK_SEPARATOR.join(parts)}] if parts else []


def _system_message(content: str | list[ContentBlock], where: str) -> str:
    """Its text; its tool changes went to `offered_tools`."""
    if isinstance(content, str):
        return content
    texts = []
    for index, block in enumerate(content):
        if block.type not in TOOL_CHANGES:
            texts.append(_block_text(block, f"{where}.content[{index}]", "text"))
    return _BLOCK_SEPARATOR.join(texts)


def _conversation(messages: list[InputMessage], image_fields: list[str]) -> list[dict]:
    """The chat messages; each image's field joins `image_fields`, in order."""
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
            chat.extend(_user(message.content, where, image_fields))
    return chat


def _assistant(content: str | list[ContentBlock], where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls = [], []
    for index, block in enumerate(content):
        at = f"{where}.content[{index}]"
        if block.type == "tool_use":
            calls.append(_call(block, at))
        elif block.type not in _DROPPED_BLOCKS:
            texts.append(_block_text(block, at, "text, tool_use and thinking"))
    message: dict[str, Any] = {"role": "assistant", "content": _BLOCK_SEPARATOR.join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _call(block: ContentBlock, where: str) -> dict:
    if block.id is None or block.name is None or block.input is None:
        raise APIError(f"{where}: a tool_use block needs id, name and input.")
    function = {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}
    return {"id": block.id, "type": "function", "function": function}


def _user(content: str | list[ContentBlock], where: str, image_fields: list[str]) -> list[dict]:
    """Tool results become tool messages; text and images between them become user messages."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    messages: list[dict] = []
    pieces: list[str | dict] = []
    for index, block in enumerate(content):
        at = f"{where}.content[{index}]"
        if block.type == "tool_result":
            if pieces:
                messages.append({"role": "user", "content": _joined(pieces)})
                pieces = []
            messages.append(_tool_result(block, at, image_fields))
        elif block.type == "image":
            pieces.append(_image(block, at, image_fields))
        else:
            pieces.append(_block_text(block, at, "text, image and tool_result"))
    if pieces:
        messages.append({"role": "user", "content": _joined(pieces)})
    return messages


def _tool_result(block: ContentBlock, where: str, image_fields: list[str]) -> dict:
    if block.tool_use_id is None:
        raise APIError(f"{where}: a tool_result block needs its tool_use_id.")
    content = block.content or ""
    if isinstance(content, str):
        result: str | list[dict] = content
    else:
        result = _joined([_result_piece(inner, f"{where}.content[{i}]", image_fields)
                          for i, inner in enumerate(content)])
    if block.is_error:
        error = "Error: "
        result = error + result if isinstance(result, str) else [_text(error), *result]
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": result}


def _result_piece(block: ContentBlock, where: str, image_fields: list[str]) -> str | dict:
    """A tool result's text or image; a tool search's `tool_reference` loaded its tool into
    `tools`."""
    if block.type == "tool_reference":
        return f"Tool {block.tool_name} loaded."
    if block.type == "image":
        return _image(block, where, image_fields)
    if block.type == "document":
        raise APIError(
            f"{where}: a tool_result holds a block of type 'document'; documents are not read "
            "here, so send their text (a string or text blocks)."
        )
    return _block_text(block, where, "text, image and tool_reference")


def _image(block: ContentBlock, where: str, image_fields: list[str]) -> dict:
    """The chat image part of an image block; its source's field joins `image_fields`."""
    source, field = block.source, f"{where}.source"
    if source is None:
        raise APIError(f"{where}: an image block needs its source.")
    if source.type == "base64" and source.media_type and source.data is not None:
        url = f"data:{source.media_type};base64,{source.data}"
    elif source.type == "url" and source.url:
        url = source.url
    else:
        raise APIError(
            f"{field}: image sources of type {source.type!r} are not read here; send a base64 "
            "source (with media_type and data) or a url source (with url)."
        )
    image_fields.append(field)
    return {"type": "image_url", "image_url": {"url": url}}


def _joined(pieces: list[str | dict]) -> str | list[dict]:
    """Text blocks as one string, each separate; with images, parts: each run of text blocks
    one text part, each image in its place."""
    texts = [piece for piece in pieces if isinstance(piece, str)]
    if len(texts) == len(pieces):
        return _BLOCK_SEPARATOR.join(texts)
    parts: list[dict] = []
    for piece in pieces:
        if isinstance(piece, dict):
            parts.append(piece)
        elif parts and parts[-1]["type"] == "text":
            parts[-1]["text"] += _BLOCK_SEPARATOR + piece
        else:
            parts.append(_text(piece))
    return parts


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _system_field(system: str | list[ContentBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = [_block_text(block, f"system[{i}]", "text") for i, block in enumerate(system)]
    return _BLOCK_SEPARATOR.join(t for t in texts if not t.startswith(_BILLING_HEADER))


def _block_text(block: ContentBlock, where: str, supported: str) -> str:
    """The text of a text block; any other type is a 400 listing the `supported` ones."""
    if block.type != "text":
        raise APIError(
            f"{where}: content blocks of type {block.type!r} are not supported here; "
            f"send {supported} blocks."
        )
    if block.text is None:
        raise APIError(f"{where}: a text block has no 'text' field.")
    return block.text
