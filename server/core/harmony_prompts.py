"""A chat request as a harmony conversation (GPT-OSS's prompt format), rendered to token ids
by openai-harmony:

    system     identity, knowledge cutoff, today's date, reasoning effort, channels
    developer  the request's system/developer text as instructions, its function tools
    user / assistant / tool messages, in order:
        assistant text             -> the `final` channel (`commentary` beside tool calls)
        assistant reasoning        -> the `analysis` channel (the library drops it once a
                                      later final answer makes it stale)
        assistant tool call        -> `commentary`, to `functions.NAME`, JSON arguments
        tool result                -> from `functions.NAME`, to the assistant

The library encodes every text as plain text, so a control token typed by a client cannot
open or end a message.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from server.core.chat_request import ChatCompletionRequest, ChatMessage
from server.core.chat_request_tools import FunctionDefinition, Tool
from server.core.harmony_parsing import FUNCTIONS
from server.core.tool_plan import forced_functions
from server.http.errors import APIError, clip

# Harmony has three efforts; OpenAI's other names land on the nearest.
_EFFORTS = {
    "none": ReasoningEffort.LOW, "minimal": ReasoningEffort.LOW, "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH,
    "xhigh": ReasoningEffort.HIGH,
}  # fmt: skip
_INSTRUCTION_ROLES = ("system", "developer")
_CALL_CONTENT_TYPE = "<|constrain|>json"  # what GPT-OSS writes before a call's JSON


class HarmonyPrompt(NamedTuple):
    ids: list[int]  # ending with the opened assistant turn (and a forced call's header)
    forced: FunctionDefinition | None  # the function a tool_choice makes the model call
    opened: list[int]  # the ids of the turn the prompt already wrote (the call's header)


def harmony_prompt(encoding: HarmonyEncoding, chat: ChatCompletionRequest,
                   today: str) -> HarmonyPrompt:
    """The prompt; a 400 for what harmony prompts cannot carry. `today` (YYYY-MM-DD) is the
    conversation's start date."""
    forced = forced_call(chat)
    conversation = Conversation.from_messages(harmony_messages(chat, today))
    ids = list(encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
    opened = call_header_ids(encoding, forced.name) if forced is not None else []
    return HarmonyPrompt(ids + opened, forced, opened)


def harmony_messages(chat: ChatCompletionRequest, today: str) -> list[Message]:
    """The request's conversation as harmony messages, system and developer ones first."""
    _check_supported(chat)
    messages = [Message.from_role_and_content(Role.SYSTEM, _system(chat, today))]
    developer = _developer(chat)
    if developer is not None:
        messages.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}  # call id -> function name, for the results
    for index, message in enumerate(chat.messages):
        if message.role == "assistant":
            messages += _assistant(message, call_names)
        elif message.role in ("tool", "function"):
            messages.append(_tool_result(message, call_names, index))
        elif message.role == "user":
            messages.append(Message.from_role_and_content(Role.USER, message.text()))
        elif message.role not in _INSTRUCTION_ROLES:
            raise APIError(
                f"messages[{index}].role is {clip(message.role)!r}; use one of system, developer, "
                "user, assistant, tool.",
                param=f"messages[{index}].role",
            )
    return messages


def forced_call(chat: ChatCompletionRequest) -> FunctionDefinition | None:
    """The function a named tool_choice (or `required` with one tool) makes the model call.
    Harmony can open that call in the prompt; `required` among several tools it cannot."""
    if chat.tool_choice in (None, "auto", "none") or not chat.tools:
        return None
    forced = forced_functions(chat.tools, chat.tool_choice)
    if len(forced) > 1:
        raise APIError(
            "This model (GPT-OSS, harmony format) can be made to call one named function, not "
            "one of several: send tool_choice 'auto', or name the function.",
            param="tool_choice",
        )
    return forced[0]


def call_header_ids(encoding: HarmonyEncoding, name: str) -> list[int]:
    """What opens a call of `name` after `<|start|>assistant`, as the library renders a call
    (a forced call's prompt ends with it, so the model writes only the arguments)."""
    header = f" to={FUNCTIONS}{name}<|channel|>commentary {_CALL_CONTENT_TYPE}<|message|>"
    return encoding.encode(header, allowed_special="all")


def _check_supported(chat: ChatCompletionRequest) -> None:
    if chat.response_format is not None and chat.response_format.type != "text":
        raise APIError(
            "response_format is not supported for this model (GPT-OSS, harmony format): "
            "its output is a sequence of harmony messages, not one JSON value. Describe the "
            "JSON you want in the instructions instead.",
            param="response_format",
        )


def _system(chat: ChatCompletionRequest, today: str) -> SystemContent:
    effort = chat.reasoning_effort or "medium"
    if effort not in _EFFORTS:
        raise APIError(
            f"reasoning_effort is {effort!r}; use one of {', '.join(_EFFORTS)}.",
            param="reasoning_effort",
        )
    return (
        SystemContent.new()
        .with_reasoning_effort(_EFFORTS[effort])
        .with_conversation_start_date(today)
    )


def _developer(chat: ChatCompletionRequest) -> DeveloperContent | None:
    texts = [m.text() for m in chat.messages if m.role in _INSTRUCTION_ROLES and m.text()]
    tools = _offered(chat)
    if not (texts or tools):
        return None
    developer = DeveloperContent.new()
    if texts:
        developer = developer.with_instructions("\n\n".join(texts))
    if tools:
        developer = developer.with_function_tools([_tool_description(t) for t in tools])
    return developer


def _offered(chat: ChatCompletionRequest) -> list[Tool]:
    return [] if chat.tool_choice == "none" else list(chat.tools or [])


def _tool_description(tool: Tool) -> ToolDescription:
    function = tool.function
    return ToolDescription.new(
        function.name, function.description or "", parameters=function.parameters_schema()
    )


def _assistant(message: ChatMessage, call_names: dict[str, str]) -> list[Message]:
    messages = []
    if message.reasoning_content:
        messages.append(_from_assistant(message.reasoning_content, "analysis"))
    text = message.text()
    if text:  # beside calls, the text was a preamble, which GPT-OSS writes as commentary
        messages.append(_from_assistant(text, "commentary" if message.tool_calls else "final"))
    for call in message.tool_calls or ():
        call_names[call.id] = call.function.name
        arguments = _arguments_text(call.function.arguments)
        messages.append(
            _from_assistant(arguments, "commentary")
            .with_recipient(FUNCTIONS + call.function.name)
            .with_content_type(_CALL_CONTENT_TYPE)
        )
    return messages


def _from_assistant(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def _arguments_text(arguments: str) -> str:
    """The arguments as sent; an empty string (a call without arguments) as `{}`."""
    return arguments if arguments.strip() else json.dumps({})


def _tool_result(message: ChatMessage, call_names: dict[str, str], index: int) -> Message:
    name = message.name or call_names.get(message.tool_call_id or "")
    if name is None:
        raise APIError(
            f"messages[{index}] answers the call {message.tool_call_id!r}, which no earlier "
            "assistant message made; send the assistant message with that tool call first, "
            "or name the function in the tool message's name.",
            param=f"messages[{index}].tool_call_id",
        )
    author = Author.new(Role.TOOL, FUNCTIONS + name)
    return (
        Message.from_author_and_content(author, message.text())
        .with_channel("commentary")
        .with_recipient("assistant")
    )

