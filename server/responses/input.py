"""Translate a Responses request into the chat-completions request it means.

The chat path then renders the prompt (tools included), enforces `text.format` and tool
choices with the grammar, and parses tool calls, so both APIs share one behaviour. Tools and
calls go by the names `tools.ToolSet` offers the model (`namespace.name`; a custom tool's
input is the one argument of a function). Errors name the Responses field (`input[2]`,
`text.format`), not the chat field behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from server.core.chat_request import ChatCompletionRequest
from server.core.turn_events import validated_chat_request
from server.http.errors import APIError
from server.responses.custom_input import arguments_of
from server.responses.protocol import ContentPart, InputItem, ResponsesRequest, TextFormat
from server.responses.tools import ToolSet, exposed_name

# Chat fields behind the Responses fields, for errors that the chat path raises.
RESPONSES_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
# Items left out of the prompt: earlier turns' reasoning (as reasoning models' templates do),
# and the records of built-in tools that OpenAI's servers ran.
_LEFT_OUT = frozenset({
    "reasoning", "web_search_call", "file_search_call", "image_generation_call",
    "code_interpreter_call",
})  # fmt: skip
_OUTPUTS = ("function_call_output", "custom_tool_call_output")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
_LEFT_OUT_PART = "[{} left out: this server reads text only]"


def chat_request(
    body: ResponsesRequest, tools: ToolSet, history: Sequence[InputItem] | None = None
) -> ChatCompletionRequest:
    """The chat request; `max_tokens` stays None without `max_output_tokens`, so the chat
    path caps the answer at what the context has left. `history`: the stored conversation
    that `previous_response_id` names, which comes before `input`."""
    if body.previous_response_id is not None and history is None:
        # A route without the store (render) would otherwise leave the conversation out.
        raise APIError(
            "previous_response_id is not read on this route; send the whole conversation in "
            "input.",
            param="previous_response_id",
        )
    fields: dict[str, Any] = {
        "messages": _messages(body, history or ()),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "response_format": _response_format(body.text.format),
        "parallel_tool_calls": body.parallel_tool_calls,
        "tools": tools.chat_tools(),
        "cache_salt": body.cache_salt,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
    }
    # "auto" (the default) and "none" mean nothing without tools; other choices need them.
    if fields["tools"] or body.tool_choice not in ("auto", "none"):
        fields["tool_choice"] = tools.chat_choice(body.tool_choice)
    return validated_chat_request(fields, RESPONSES_PARAMS)


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


def _messages(body: ResponsesRequest, history: Sequence[InputItem]) -> list[dict]:
    """The instructions (not carried over from a previous response, as in OpenAI's API),
    then the history, then the input."""
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    located = [
        *((item, "previous_response_id") for item in history),
        *((item, f"input[{index}]") for index, item in enumerate(body.input_items())),
    ]
    for item, where in located:
        if item.type == "message":
            messages.append(_message(item, where))
        elif item.type in ("function_call", "custom_tool_call"):
            _add_call(messages, _call(item, where))
        elif item.type in _OUTPUTS:
            if item.call_id is None or item.output is None:
                raise _item_error(where, f"a {item.type} needs call_id and output.")
            output = _output_text(item.output, where)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif item.type not in _LEFT_OUT:
            raise _item_error(
                where,
                f"input items of type {item.type!r} are not supported; send message, "
                "function_call, custom_tool_call, their outputs, and reasoning items.",
            )
    return messages


def _message(item: InputItem, where: str) -> dict:
    if item.role not in _ROLES or item.content is None:
        roles = ", ".join(_ROLES)
        raise _item_error(where, f"a message needs a role (one of {roles}) and content.")
    return {"role": item.role, "content": _text(item.content, where)}


def _call(item: InputItem, where: str) -> dict:
    """The chat tool call of a function_call or custom_tool_call item, named as the model
    was offered the tool (a custom tool's input is its one argument)."""
    arguments = item.arguments if item.type == "function_call" else item.input
    if item.call_id is None or item.name is None or arguments is None:
        needs = "arguments" if item.type == "function_call" else "input"
        raise _item_error(where, f"a {item.type} needs call_id, name and {needs}.")
    if item.type == "custom_tool_call":
        arguments = arguments_of(arguments)
    name = exposed_name(item.name, item.namespace)
    return {"id": item.call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _add_call(messages: list[dict], call: dict) -> None:
    """A call joins the assistant message before it (the turn that made it)."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _output_text(content: str | list[ContentPart], where: str) -> str:
    """A tool's output. An agent cannot keep a tool (Codex's view_image) from returning an
    image, so images and files become a note instead of a 400 that would end its session."""
    if isinstance(content, str):
        return content
    parts = [
        ContentPart(type="input_text", text=_LEFT_OUT_PART.format(part.type[len("input_"):]))
        if part.type in _MEDIA_PARTS else part
        for part in content
    ]  # fmt: skip
    return _text(parts, where)


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
