"""The tools of a Responses request as the model sees them, and the way back to the client's.

Responses tools come in more kinds than chat tools; each is offered as chat functions:

    function           offered as it is
    namespace          its members offered as `<namespace>.<name>`; a call of one comes back
                       with the member's own `name` and the `namespace`, as the API returns it
    custom             free-form text input: offered as a function with one string argument,
                       `input`; a call comes back as a `custom_tool_call` with that `input`
    built-in tools     `web_search`, `file_search`, ... run on OpenAI's side; this server runs
                       none, so they are accepted and left out of the prompt

A custom tool's grammar (`format`) is shown to the model in the description, not enforced:
the call's JSON is what the sampler may constrain, not the text inside its string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from server.core.chat_request_tools import MAX_TOOL_NAME_LENGTH, ToolName
from server.http.errors import APIError
from server.http.limits import check_tool_count
from server.responses.protocol import ToolChoice

BUILT_IN_TOOL_TYPES = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
    "file_search", "image_generation", "code_interpreter", "computer", "computer_use",
    "computer_use_preview", "mcp", "local_shell", "shell", "apply_patch", "tool_search",
    "programmatic_tool_calling",
})  # fmt: skip
_MEMBER_TYPES = ("function", "custom")


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomFormat(BaseModel):
    type: Literal["text", "grammar"] = "text"
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomTool(BaseModel):
    type: Literal["custom"]
    name: ToolName
    description: str | None = None
    format: CustomFormat | None = None


class NamespaceTool(BaseModel):
    type: Literal["namespace"]
    name: ToolName
    description: str | None = None
    tools: list[dict[str, Any]] = Field(min_length=1)


@dataclass(frozen=True)
class ClientTool:
    """A function or custom tool the client runs, and the chat function the model calls."""

    kind: Literal["function", "custom"]
    name: str  # the client's name for it
    namespace: str | None
    function: dict[str, Any]  # the chat function offered: its name is the model's name for it


def exposed_name(name: str, namespace: str | None) -> str:
    return f"{namespace}.{name}" if namespace else name


class ToolSet:
    """The client tools of one request, by the names the model calls them."""

    def __init__(self, tools: list[ClientTool]) -> None:
        self._tools = {tool.function["name"]: tool for tool in tools}

    def chat_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": tool.function} for tool in self._tools.values()]

    def called(self, name: str) -> ClientTool | None:
        """The tool the model called by `name`; None for a name the request did not offer."""
        return self._tools.get(name)

    def chat_choice(self, choice: ToolChoice) -> str | dict[str, Any]:
        """The chat `tool_choice` of a Responses one (a mode, or a named function / custom)."""
        if isinstance(choice, str):
            return choice
        tool = self._tools.get(exposed_name(choice.name, choice.namespace))
        if tool is None or tool.kind != choice.type:
            message = f"tool_choice names the {choice.type} {choice.name!r}, which is not in tools."
            raise APIError(message, param="tool_choice")
        return {"type": "function", "function": {"name": tool.function["name"]}}


def read_tools(raw: list[dict[str, Any]]) -> ToolSet:
    """The request's tools; a 400 naming the tool (`tools[3].tools[0].name`) if one is bad."""
    tools: list[tuple[ClientTool, str]] = []
    for index, tool in enumerate(raw):
        tools += _read_tool(tool, f"tools[{index}]")
        check_tool_count(len(tools))  # namespace members count one each
    seen: dict[str, str] = {}
    for tool, where in tools:
        name = tool.function["name"]
        if name in seen:
            message = f"the tool name {name!r} is already used by {seen[name]}."
            raise APIError(f"{where}.name: {message}", param=f"{where}.name")
        seen[name] = where
    return ToolSet([tool for tool, _ in tools])


def _read_tool(tool: dict[str, Any], where: str) -> list[tuple[ClientTool, str]]:
    """The client tools in one entry of `tools` (none, one, or a namespace's), with where."""
    kind = _tool_type(tool, where)
    if kind in BUILT_IN_TOOL_TYPES:
        return []  # run by OpenAI's servers; the model is not told about it
    if kind == "namespace":
        namespace = _parsed(NamespaceTool, tool, where)
        members = [(member, f"{where}.tools[{i}]") for i, member in enumerate(namespace.tools)]
        return [(_member(member, namespace, place), place) for member, place in members]
    if kind in _MEMBER_TYPES:
        return [(_member(tool, None, where), where)]
    supported = ", ".join(["function", "custom", "namespace", *sorted(BUILT_IN_TOOL_TYPES)])
    message = f"unknown tool type {kind!r}; supported: {supported}."
    raise APIError(f"{where}.type: {message}", param=f"{where}.type")


def _tool_type(tool: dict[str, Any], where: str) -> str:
    """The entry's `type`; a 400 naming it if it is missing or not a string (a list or an
    object would not even be looked up among the known types)."""
    kind = tool.get("type")
    if not isinstance(kind, str):
        problem = "a tool needs a type" if kind is None else f"must be a string, not {kind!r}"
        raise APIError(f"{where}.type: {problem}.", param=f"{where}.type")
    return kind


def _member(tool: dict[str, Any], namespace: NamespaceTool | None, where: str) -> ClientTool:
    """A function or custom tool, inside `namespace` if it is not None."""
    kind = _tool_type(tool, where)
    if kind not in _MEMBER_TYPES:
        problem = "a namespace holds only function and custom tools"
        raise APIError(f"{where}.type: {problem}, not {kind!r}.", param=f"{where}.type")
    parsed = _parsed(FunctionTool if kind == "function" else CustomTool, tool, where)
    prefix = namespace.name if namespace else None
    name = exposed_name(parsed.name, prefix)
    if len(name) > MAX_TOOL_NAME_LENGTH:
        message = (f"the namespace and tool names together are longer than "
                   f"{MAX_TOOL_NAME_LENGTH} characters.")  # fmt: skip
        raise APIError(f"{where}.name: {message}", param=f"{where}.name")
    notes = [_namespace_note(namespace)] if namespace else []
    if isinstance(parsed, CustomTool):
        chat = {"name": name, "description": _custom_description(parsed, notes),
                "parameters": _CUSTOM_PARAMETERS}  # fmt: skip
        return ClientTool("custom", parsed.name, prefix, chat)
    fields = parsed.model_dump(include={"parameters", "strict"})
    description = "\n".join([*notes, parsed.description or ""]).strip() or None
    chat = {**fields, "name": name, "description": description}
    return ClientTool("function", parsed.name, prefix, chat)


def _namespace_note(namespace: NamespaceTool) -> str:
    about = f": {namespace.description}" if namespace.description else ""
    return f"Part of `{namespace.name}`{about}"


# A custom tool's free-form input, as the one argument of the function the model calls.
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's input, as text."}},
    "required": ["input"],
    "additionalProperties": False,
}


def _custom_description(tool: CustomTool, notes: list[str]) -> str:
    lines = [*notes, tool.description or ""]
    lines.append('Call it with one argument, "input": the text the tool takes, as a string.')
    grammar = tool.format
    if grammar is not None and grammar.type == "grammar" and grammar.definition:
        lines.append(f"The text must match this {grammar.syntax or 'lark'} grammar:")
        lines.append(grammar.definition)
    return "\n".join(line for line in lines if line)


def _parsed(model: type[BaseModel], tool: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(tool)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = where + "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]
        )
        raise APIError(f"{param}: {error['msg']}", param=param) from exc
