"""Request and response shapes of the OpenAI Responses API (the subset we serve).

Unknown request fields are ignored (Codex sends `reasoning`, `include`, `prompt_cache_key`,
`client_metadata`, ...). `store` and `previous_response_id` are served (server.responses.store);
the other fields that need state on the server (`background: true`, `conversation`, `prompt`)
are refused by name.
Input items and tools are loose here and checked when the request is translated, so that
errors can name the item (`input[2]`, `tools[4].tools[0].name`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.http.unicode import (
    ESCAPED_SURROGATE,
    escapes_lone_surrogate,
    refuse_lone_surrogates,
)

# ---- requests -------------------------------------------------------------------------------


class ContentPart(BaseModel):
    type: str  # input_text, output_text and input_image are supported
    text: str | None = None
    image_url: str | None = None  # input_image: a data URL or an http(s) URL
    file_id: str | None = None  # input_image, input_file: refused (no files are kept)
    detail: str | None = None  # input_image: low, high or auto (others read as auto)


class InputItem(BaseModel):
    """A message, a (custom) tool call or its output, or a reasoning item."""

    type: str = "message"  # "easy" input messages leave it out
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None  # calls and their outputs
    name: str | None = None  # function_call, custom_tool_call
    namespace: str | None = None  # a call of a namespace's tool
    arguments: str | None = None  # function_call
    input: str | None = None  # custom_tool_call
    output: str | list[ContentPart] | None = None  # function_call_output, custom_tool_call_output

    @field_validator("arguments")
    @classmethod
    def _valid_unicode(cls, arguments: str | None) -> str | None:
        if arguments is not None and escapes_lone_surrogate(arguments):
            raise ValueError(ESCAPED_SURROGATE)
        return arguments


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str
    namespace: str | None = None


class NamedCustomTool(BaseModel):
    type: Literal["custom"]
    name: str
    namespace: str | None = None


ToolChoice = Literal["none", "auto", "required"] | NamedFunction | NamedCustomTool


class TextFormat(BaseModel):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(validate_by_name=True, serialize_by_alias=True)


class TextConfig(BaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningConfig(BaseModel):
    """How hard a reasoning model thinks (GPT-OSS reads it; other models' templates ignore
    it). No summaries are made: the reasoning comes out whole."""

    effort: str | None = None


_STATE_HINT = (
    "this server keeps no conversations or background responses; send the conversation in "
    "`input`, or continue a stored response with `previous_response_id`"
)
# OpenAI's limits on `metadata`.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class ResponsesRequest(BaseModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)  # read by `tools.read_tools`
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    # As on chat requests: prompts of different salts share no prefix-cache blocks.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    store: bool | None = None  # None: server.responses.store.STORE_BY_DEFAULT
    previous_response_id: str | None = Field(default=None, min_length=1)
    # Server-side state we keep none of: refused when asked for (validators run only on
    # fields that were sent).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    # The response echoes fields back (metadata, text.format), and such text cannot be
    # encoded: it must be refused before any work, not fail after the generation.
    _valid_unicode = model_validator(mode="before")(refuse_lone_surrogates)

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs are allowed, got {len(value)}")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters")
            if len(text) > MAX_METADATA_VALUE:
                raise ValueError(f"values are at most {MAX_METADATA_VALUE} characters ({key!r})")
        return value

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if not value:
            raise ValueError("input must not be empty")
        return value

    def input_items(self) -> list[InputItem]:
        """`input` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [InputItem(type="message", role="user", content=self.input)]
        return self.input

    @field_validator("background")
    @classmethod
    def _not_true(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError(f"true is not supported: {_STATE_HINT}")
        return value

    @field_validator("conversation", "prompt")
    @classmethod
    def _not_sent(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(f"refers to stored state: {_STATE_HINT}")
        return value


# ---- responses ------------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(BaseModel):
    """A reasoning model's `<think>` text, in full (there is no summary). Nothing is
    encrypted: sent back, reasoning is left out of the prompt, so `encrypted_content` has
    nothing to carry and is always null."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: None = None


# A call of a namespace's tool names the namespace; other calls leave the field out.
_NAMESPACE = Field(default=None, exclude_if=lambda value: value is None)


class FunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    namespace: str | None = _NAMESPACE
    arguments: str
    status: ItemStatus


class CustomToolCall(BaseModel):
    type: Literal["custom_tool_call"] = "custom_tool_call"
    id: str
    call_id: str
    name: str
    namespace: str | None = _NAMESPACE
    input: str
    status: ItemStatus


OutputItem = ReasoningItem | OutputMessage | FunctionCall | CustomToolCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
        return cls(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The Response resource; its request fields are echoed as the API does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    store: bool = False
    temperature: float | None
    text: TextConfig
    tool_choice: ToolChoice
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
