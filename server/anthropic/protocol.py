"""Request and response shapes of the Anthropic Messages API (the subset we serve).

Unknown request fields are ignored: clients send many we have no use for (`metadata`,
`cache_control`, `thinking`, `context_management`, `output_config`, ...). Content blocks are
one loose model whose fields are checked when the conversation is translated, so that errors
can name the message and block.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from server.core.chat_request_tools import ToolName

# ---- requests -------------------------------------------------------------------------------


class ImageBlockSource(BaseModel):
    """An image block's picture: `base64` (`media_type` and `data`) or `url`."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ContentBlock(BaseModel):
    """A `text`, `image`, `tool_use` or `tool_result` block, the `tool_reference` blocks that
    load deferred tools, the `tool_addition` / `tool_removal` blocks of a `system` message that
    change the tools mid-conversation (or a block we reject when translating)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use; tool_reference (inside tool_addition / tool_removal)
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None  # tool_result
    is_error: bool = False  # tool_result
    tool_name: str | None = None  # tool_reference (in a tool_result)
    tool: ToolChange | None = None  # tool_addition, tool_removal
    source: ImageBlockSource | None = None  # image


class ToolChange(BaseModel):
    """The tool a `tool_addition` / `tool_removal` names: a `tool_reference` to one of
    `tools`, or a whole `tool_definition`."""

    type: str
    name: str | None = None  # tool_reference
    definition: Tool | None = None  # tool_definition


class InputMessage(BaseModel):
    # "system" is not in the API, but clients send it; it is folded into the system prompt.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(BaseModel):
    """A client tool (no type, or "custom"), or a server tool such as `web_search_20250305`
    that Anthropic runs itself. Server tools are accepted and left out of the prompt: there
    is nothing here to run them, and Claude Code sends them by default."""

    type: str | None = None
    name: ToolName  # deferred ones too: they may be loaded later
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    defer_loading: bool = False  # out of the prompt until a tool_reference loads it

    @property
    def is_client_tool(self) -> bool:
        return self.type in (None, "custom")

    @model_validator(mode="after")
    def _schema_for_client_tool(self) -> Tool:
        if self.is_client_tool and self.input_schema is None:
            raise ValueError(f"tool {self.name!r} needs an input_schema")
        return self


ContentBlock.model_rebuild()  # its `tool` field names ToolChange and Tool, defined after it


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice of type "tool" needs the tool\'s name')
        return self


class CountTokensRequest(BaseModel):
    """What decides the prompt: the body of /v1/messages/count_tokens."""

    model: str | None = None
    messages: list[InputMessage]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[InputMessage]) -> list[InputMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

    @model_validator(mode="after")
    def _usable_tool_choice(self) -> CountTokensRequest:
        choice = self.tool_choice
        if choice is not None and choice.type == "any" and not self.tools:
            raise ValueError('tool_choice "any" needs tools')
        names = {tool.name for tool in self.tools}
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        return self


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] = Field(default_factory=list)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False


# ---- responses ------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str = ""


class ThinkingBlock(BaseModel):
    """A reasoning model's `<think>` text. It carries no signature: nothing checks one here."""

    type: Literal["thinking"] = "thinking"
    thinking: str = ""
    signature: str = ""


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    """`input_tokens` excludes the prompt tokens read from the prefix cache, as Anthropic's
    usage does: the prompt is `input_tokens + cache_read_input_tokens`."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> AnthropicUsage:
        return cls(
            input_tokens=prompt_tokens - cached_tokens,
            output_tokens=output_tokens,
            cache_read_input_tokens=cached_tokens,
        )


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class TokenCount(BaseModel):
    input_tokens: int
