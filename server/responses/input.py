"""Translate a Responses request into the chat-completions request it means.

The chat path then renders the prompt (tools included), enforces `text.format` and tool
choices with the grammar, and parses tool calls, so both APIs share one behaviour. Tools and
calls go by the names `tools.ToolSet` offers the model (`namespace.name`; a custom tool's
input is the one argument of a function). Errors name the Responses field (`input[2]`,
`text.format`, `input[3].output[1].image_url`), not the chat field behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from server.core.chat_request import ChatCompletionRequest
from server.core.turn_events import validated_chat_request
from server.http.errors import APIError
from server.media.images import DETAILS
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
# A tool's files and sounds become notes (an agent cannot keep its tools from returning
# them, and a 400 would end its session); its images are images (server.core.chat_images).
_NOTED_PARTS = ("input_file", "input_audio")
_LEFT_OUT_PART = "[{} left out: this server reads text only]"
# Where the items of a stored conversation are named in errors.
_HISTORY = "previous_response_id"


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
    image_fields: list[str] = []
    fields: dict[str, Any] = {
        "messages": _messages(body, history or (), image_fields),
        "model": body.model,
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
    return validated_chat_request(fields, RESPONSES_PARAMS, image_fields)


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


def _messages(
    body: ResponsesRequest, history: Sequence[InputItem], image_fields: list[str]
) -> list[dict]:
    """The instructions (not carried over from a previous response, as in OpenAI's API),
    then the history, then the input; each image's field joins `image_fields`, in order."""
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    located = [
        *((item, _HISTORY) for item in history),
        *((item, f"input[{index}]") for index, item in enumerate(body.input_items())),
    ]
    for item, where in located:
        if item.type == "message":
            messages.append(_message(item, where, image_fields))
        elif item.type in ("function_call", "custom_tool_call"):
            _add_call(messages, _call(item, where))
        elif item.type in _OUTPUTS:
            if item.call_id is None or item.output is None:
                raise _item_error(where, f"a {item.type} needs call_id and output.")
            output = _output(item.output, where, image_fields)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif item.type not in _LEFT_OUT:
            raise _item_error(
                where,
                f"input items of type {item.type!r} are not supported; send message, "
                "function_call, custom_tool_call, their outputs, and reasoning items.",
            )
    return messages


def _message(item: InputItem, where: str, image_fields: list[str]) -> dict:
    if item.role not in _ROLES or item.content is None:
        roles = ", ".join(_ROLES)
        raise _item_error(where, f"a message needs a role (one of {roles}) and content.")
    return {"role": item.role, "content": _content(item.content, where, "content", image_fields)}


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


def _output(
    content: str | list[ContentPart], where: str, image_fields: list[str]
) -> str | list[dict]:
    """A tool's output; its files and sounds become notes."""
    if isinstance(content, str):
        return content
    parts = [
        ContentPart(type="input_text", text=_LEFT_OUT_PART.format(part.type[len("input_"):]))
        if part.type in _NOTED_PARTS else part
        for part in content
    ]  # fmt: skip
    return _content(parts, where, "output", image_fields)


def _content(
    content: str | list[ContentPart], where: str, key: str, image_fields: list[str]
) -> str | list[dict]:
    """The chat content of an item's `key` (its content or output): one string of its text
    parts, or with images, text and image parts in order."""
    if isinstance(content, str):
        return content
    parts = [_part(part, where, f"{key}[{i}]", image_fields) for i, part in enumerate(content)]
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _part(part: ContentPart, where: str, path: str, image_fields: list[str]) -> dict:
    if part.type == "input_image":
        return _image(part, where, path, image_fields)
    if part.type not in _TEXT_PARTS or part.text is None:
        raise _item_error(
            where,
            f"content parts of type {part.type!r} are not supported; send input_text and "
            "input_image parts (output_text for earlier assistant turns).",
        )
    return {"type": "text", "text": part.text}


def _image(part: ContentPart, where: str, path: str, image_fields: list[str]) -> dict:
    """The chat image part of an input_image; its field joins `image_fields`."""
    if part.image_url is None:
        by_id = part.file_id is not None
        field = _inside(where, f"{path}.{'file_id' if by_id else 'image_url'}")
        how = ("file ids are not supported (this server keeps no files)" if by_id
               else "an input_image needs its image_url")
        raise APIError(
            f"{field}: {how}; send the image in image_url, as a data URL "
            "(data:image/png;base64,...) or an http(s) URL.",
            param=field,
        )  # fmt: skip
    image_fields.append(_inside(where, f"{path}.image_url"))
    detail = part.detail if part.detail in DETAILS else "auto"
    return {"type": "image_url", "image_url": {"url": part.image_url, "detail": detail}}


def _inside(where: str, path: str) -> str:
    """The field at `path` in the item at `where`; a stored item's is `previous_response_id`."""
    return where if where == _HISTORY else f"{where}.{path}"


def _item_error(where: str, problem: str) -> APIError:
    return APIError(f"{where}: {problem}", param=where)
