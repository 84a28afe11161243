"""What a chat request's tools change: the conversation the chat template sees, the JSON
schema the sampler enforces, and the parser that finds calls in the model's text.

Two ways to offer tools:
- native: the chat template has tool syntax (it reads `tools`); tools, assistant tool calls
  and tool results go to it as they are, and the family's parser reads the calls;
- described: the template knows nothing of tools (the default model's); a system message
  describes them and asks for Hermes-style `<tool_call>` blocks, and tool traffic becomes
  plain text.
With `tool_choice` "required" or a named function, the call is generated under a JSON schema
of `{"name": ..., "arguments": ...}` either way, so its arguments always parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from scheduler.sampling_params import StructuredOutput
from server.core.chat_request import ChatCompletionRequest, ChatMessage
from server.core.chat_request_tools import FunctionDefinition, Tool, ToolCall
from server.core.tool_parser_choice import parser_for_template, parser_named
from server.core.tool_parsers import ForcedCallParser, HermesParser, ToolParser
from server.http.errors import APIError, clip

# The roles OpenAI's chat API knows. A template writes the role into the prompt as it is, so
# any other (`"system<|im_end|>..."`) could forge turns.
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# The chat templates of most models know only these roles; "developer" is OpenAI's new
# name for the system prompt.
_ROLE_ALIASES = {"developer": "system"}

_DESCRIBED_CALL_FORMAT = (
    'To call a function, reply with <tool_call>{"name": <function name>, "arguments": '
    "<arguments object>}</tool_call>, one block per call, and nothing else. "
    "Otherwise answer normally."
)
_FORCED_CALL_FORMAT = (
    'Reply with one function call as JSON: {"name": <function name>, "arguments": '
    "<arguments object>}."
)


def has_tool_syntax(template: str) -> bool:
    return "tools" in template


def takes_tools(template: str) -> bool:
    """Whether a chat model lists the "tools" capability: its template renders tools itself,
    or writes calls in a family's syntax that a parser reads."""
    return has_tool_syntax(template) or parser_for_template(template) is not None


@dataclass(frozen=True)
class ToolPlan:
    native: bool  # the chat template renders tools itself
    offered: list[Tool]  # the tools the model is told about
    forced: list[FunctionDefinition]  # functions one of which must be called (else empty)
    parser: ToolParser | None  # finds calls in the output; None when no tools are offered

    def conversation(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The messages as the chat template takes them; a 400 for a role the API lacks."""
        _check_roles(messages)
        turns = [self._turn(m) for m in messages]
        if self.offered and not self.native:
            turns = _with_system_note(turns, self._description())
        return turns

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` argument of `apply_chat_template`."""
        if not (self.native and self.offered):
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.offered]

    def structured(self) -> StructuredOutput | None:
        """The schema a forced call is generated under: one function's, or any of several."""
        if not self.forced:
            return None
        defs: dict[str, Any] = {}  # parameters that refer into themselves, by call
        schemas = [_call_schema(f, f"args{i}", defs) for i, f in enumerate(self.forced)]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        if defs:
            schema = {**schema, "$defs": defs}
        return StructuredOutput(json_schema=json.dumps(schema))

    def _turn(self, message: ChatMessage) -> dict[str, Any]:
        role = _ROLE_ALIASES.get(message.role, message.role)
        content = message.template_content()
        if self.native:
            turn: dict[str, Any] = {"role": role, "content": content}
            if message.tool_calls:
                turn["tool_calls"] = [_template_call(call) for call in message.tool_calls]
            if message.tool_call_id is not None:
                turn["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                turn["name"] = message.name
            return turn
        if message.tool_calls:  # an assistant's: its content is text
            blocks = [f"<tool_call>{_call_json(call)}</tool_call>" for call in message.tool_calls]
            content = "\n".join([message.text(), *blocks]).strip()
        if role == "tool":
            # Templates without tool syntax often refuse unknown roles: results come as user text.
            source = message.name or message.tool_call_id or "a function"
            return {"role": "user", "content": _led_by(f"Result of the call to {source}:\n",
                                                       content)}
        return {"role": role, "content": content}

    def _description(self) -> str:
        functions = json.dumps([t.function.model_dump(exclude_none=True) for t in self.offered])
        how = _FORCED_CALL_FORMAT if self.forced else _DESCRIBED_CALL_FORMAT
        return f"You can call these functions:\n{functions}\n{how}"


def _led_by(text: str, content: str | list[dict[str, str]]) -> str | list[dict[str, str]]:
    """`content` (a string, or parts with images) after `text`."""
    if isinstance(content, str):
        return text + content
    return [{"type": "text", "text": text}, *content]


def plan_tools(body: ChatCompletionRequest, template: str, parser_name: str | None) -> ToolPlan:
    """The tool plan of a request; a 400 naming the field if tools and choice disagree.

    `parser_name` (the server's `--tool-call-parser`) overrides the parser picked from the
    template's text, for templates with tool syntax.
    """
    native = has_tool_syntax(template)
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(f"tool_choice {_choice_name(choice)} needs tools.", param="tool_choice")
    if choice == "none":
        return ToolPlan(native, [], [], None)
    forced = forced_functions(tools, choice)
    if forced and body.response_format is not None and body.response_format.type != "text":
        raise APIError(
            "response_format cannot be combined with a required or named tool_choice: the "
            "call is already generated under its own JSON schema.",
            param="response_format",
        )
    parser = _parser(native, forced, template, parser_name)
    schemas = {tool.function.name: tool.function.parameters_schema() for tool in tools}
    return ToolPlan(native, tools, forced, parser.for_tools(schemas))


def _check_roles(messages: list[ChatMessage]) -> None:
    for index, message in enumerate(messages):
        if message.role not in _ROLES:
            raise APIError(
                f"messages[{index}].role is {clip(message.role)!r}; use one of "
                f"{', '.join(_ROLES)}.",
                param=f"messages[{index}].role",
            )


def forced_functions(tools: list[Tool], choice: Any) -> list[FunctionDefinition]:
    """The functions one of which `choice` makes the model call (none for auto); a 400 for
    a name that is not in `tools`."""
    if choice == "auto":
        return []
    if choice == "required":
        return [tool.function for tool in tools]
    named = [t.function for t in tools if t.function.name == choice.function.name]
    if not named:
        raise APIError(
            f"tool_choice names the function {choice.function.name!r}, which is not in tools.",
            param="tool_choice",
        )
    return named


def _parser(
    native: bool, forced: list[FunctionDefinition], template: str, parser_name: str | None
) -> ToolParser:
    if forced:
        return ForcedCallParser()
    if not native:
        return HermesParser()  # the format the tool description asks for
    if parser_name is not None:
        return parser_named(parser_name)
    return parser_for_template(template) or HermesParser()


def _choice_name(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.function.name)


def _call_schema(function: FunctionDefinition, key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A call of `function`: its name and its arguments. Parameters that refer into
    themselves (`"$ref": "#/$defs/Item"`) move to `defs[key]`, their references rebased
    there, since in the call's schema `#` is the call, not the parameters."""
    arguments = function.parameters_schema()
    if _has_ref(arguments):
        defs[key] = _rebased(arguments, f"#/$defs/{key}")
        arguments = {"$ref": f"#/$defs/{key}"}
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [function.name]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return isinstance(schema.get("$ref"), str) or any(map(_has_ref, schema.values()))
    return isinstance(schema, list) and any(map(_has_ref, schema))


def _rebased(schema: Any, root: str) -> Any:
    """`schema` with each local reference ("#...") pointing under `root` instead."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        key: root + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
        else _rebased(value, root)
        for key, value in schema.items()
    }


def _template_call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.function.name, "arguments": call.function.arguments_object()}
    return {"id": call.id, "type": "function", "function": function}


def _call_json(call: ToolCall) -> str:
    arguments = call.function.arguments_object()
    return json.dumps({"name": call.function.name, "arguments": arguments}, ensure_ascii=False)


def _with_system_note(turns: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    if turns and turns[0]["role"] == "system":
        first = {**turns[0], "content": f"{turns[0]['content']}\n\n{note}"}
        return [first, *turns[1:]]
    return [{"role": "system", "content": note}, *turns]
