"""Translate a Responses request into the chat-completions request it means.

The chat path then renders the prompt (tools included), enforces `text.format` and tool
choices with the grammar, and parses tool calls, so both APIs share one behaviour. Errors name
the Responses field (`input[2]`, `text.format`), not the chat field behind it.
"""

from __future__ import annotations

from typing import Any

from server.core.assistant_turn import validated_chat_request
from server.http.errors import APIError
from server.openai.protocol import ChatCompletionRequest
from server.responses.protocol import (
    ContentPart,
    InputItem,
    NamedFunction,
    ResponsesRequest,
    TextFormat,
)

# Chat fields behind the Responses fields, for errors that the chat path raises.
RESPONSES_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    fields: dict[str, Any] = {
        "messages": _messages(body),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "response_format": _response_format(body.text.format),
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    function_fields = {"name", "description", "parameters", "strict"}
    fields["tools"] = [
        {"type": "function", "function": tool.model_dump(include=function_fields)}
        for tool in body.tools
    ]
    # "auto" (the default) and "none" mean nothing without tools; other choices need them.
    if body.tools or body.tool_choice not in ("auto", "none"):
        fields["tool_choice"] = _tool_choice(body)
    return validated_chat_request(fields, RESPONSES_PARAMS)


def _tool_choice(body: ResponsesRequest) -> str | dict:
    choice = body.tool_choice
    if not isinstance(choice, NamedFunction):
        return choice
    if choice.name not in {tool.name for tool in body.tools}:
        message = f"tool_choice names {choice.name!r}, which is not in tools."
        raise APIError(message, param="tool_choice")
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(text_format: TextFormat) -> dict:
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    if text_format.json_schema is None:
        raise APIError('text.format of type "json_schema" needs a "schema".', param="text.format")
    return {
        "type": "json_schema",
        "json_schema": {
            "name": text_format.name or "response",
            "schema": text_format.json_schema,
            "strict": text_format.strict,
        },
    }


def _messages(body: ResponsesRequest) -> list[dict]:
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for index, item in enumerate(body.input):
        where = f"input[{index}]"
        if item.type == "message":
            messages.append(_message(item, where))
        elif item.type == "function_call":
            _add_call(messages, item, where)
        elif item.type == "reasoning":
            continue  # earlier turns' reasoning stays out, as reasoning models' templates do
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise _item_error(where, "a function_call_output needs call_id and output.")
            output = _text(item.output, where)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            raise _item_error(
                where,
                f"input items of type {item.type!r} are not supported; send message, "
                "function_call, function_call_output and reasoning items.",
            )
    return messages


def _message(item: InputItem, where: str) -> dict:
    if item.role not in _ROLES or item.content is None:
        roles = ", ".join(_ROLES)
        raise _item_error(where, f"a message needs a role (one of {roles}) and content.")
    return {"role": item.role, "content": _text(item.content, where)}


def _add_call(messages: list[dict], item: InputItem, where: str) -> None:
    """A function call joins the assistant message before it (the turn that made it)."""
    if item.call_id is None or item.name is None or item.arguments is None:
        raise _item_error(where, "a function_call needs call_id, name and arguments.")
    call = {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _text(content: str | list[ContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type not in _TEXT_PARTS or part.text is None:
            raise _item_error(
                where,
                f"content parts of type {part.type!r} are not supported; send input_text "
                "parts (output_text for earlier assistant turns).",
            )
        texts.append(part.text)
    return "".join(texts)


def _item_error(where: str, problem: str) -> APIError:
    return APIError(f"{where}: {problem}", param=where)
