"""Shapes of the OpenAI chat and completions APIs (the subset we serve) beyond the core's chat
request (server.core.chat_request, whose shape is this API's): the completions request, and
the responses and stream chunks of both.

Unknown request fields are ignored: clients send many we have no use for. The fields we model
are checked as OpenAI checks them (docs/openai-api.md, "Validation"); a check that pydantic
cannot say with a field constraint raises `invalid_at`, so the 400 still names the field.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from scheduler.request import FinishReason
from server.core.chat_request import MAX_TOKEN_ID, ChatFinishReason, GenerationRequest, Usage
from server.core.chat_request_tools import ToolCall
from server.http.errors import APIError, invalid_at

# ---- requests -------------------------------------------------------------------------------

# One prompt (text or token ids) or a batch of them.
PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(GenerationRequest):
    prompt: PromptInput
    logprobs: int | None = None  # alternatives per token, checked by server.http.limits
    echo: bool = False
    suffix: str | None = None  # fill-in-the-middle: refused unless empty
    # OpenAI's range; candidates are not ranked here, so only best_of == n is served.
    best_of: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, prompt: PromptInput) -> PromptInput:
        if not prompt or any(p in ("", []) for p in (prompt if isinstance(prompt, list) else ())):
            raise ValueError("prompt must not be empty, nor hold an empty prompt")
        if any(not 0 <= t <= MAX_TOKEN_ID for ids in _token_id_lists(prompt) for t in ids):
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
        return prompt

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        """best_of candidates, of which the n most likely return: with best_of == n that is
        every candidate, in any order: all that this server serves."""
        if self.best_of is None or self.best_of == self.n:
            return self
        if self.best_of < self.n:
            refused = f"best_of ({self.best_of}) must be at least n ({self.n})"
        else:
            refused = (
                f"best_of {self.best_of} with n {self.n} is not supported: the server does "
                "not rank candidates; send n candidates (best_of equal to n or unset) with "
                "logprobs and pick among them"
            )
        raise invalid_at((("best_of",), refused))

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError(
                "fill-in-the-middle is not supported; send the text before the gap as the "
                "prompt, without a suffix"
            )
        return suffix

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch, each as text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def num_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            raise APIError(
                "echo with logprobs needs the prompt's logprobs, which this server does not "
                "compute; drop echo or logprobs.",
                param="echo",
            )
        return self.logprobs


def _token_id_lists(prompt: PromptInput) -> list[list[int]]:
    if isinstance(prompt, str):
        return []
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return [p for p in prompt if isinstance(p, list)]


# ---- responses ------------------------------------------------------------------------------

class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, `text_offset` indexing the choice text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


def _drop_nulls(data: dict, keep: tuple[str, ...] = ()) -> dict:
    return {key: value for key, value in data.items() if value is not None or key in keep}


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_extras(self, handler: SerializerFunctionWrapHandler) -> dict:
        return _drop_nulls(handler(self), keep=("content",))  # content is null beside calls


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: ChatFinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None  # on a call's first delta only
    arguments: str = ""  # the next fragment of the arguments' JSON text


class ToolCallDelta(BaseModel):
    """What one stream chunk adds to the call at `index`: the first delta of a call carries
    its `id`, `type` and name, the later ones only argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        data["function"] = {k: v for k, v in data["function"].items() if v is not None}
        return {key: value for key, value in data.items() if value is not None}


class ChatDelta(BaseModel):
    """Only the fields a chunk carries: `{"content": "..."}`, or `{}` on the last chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict:
        return _drop_nulls(handler(self))


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: ChatFinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Response):
    """Both the whole completion and its stream chunks (the API uses one shape for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "metal-serve"
    max_model_len: int | None = None  # as vLLM's cards say
    # What a request gets for the sampling fields it leaves unset (see --generation-config).
    sampling_defaults: dict[str, float | int | None] | None = None
    # Parameters in all, and those each token runs through (fewer for a mixture of experts).
    num_parameters: int | None = None
    active_parameters: int | None = None
    # What it serves: "completion", "chat" (a chat template), "vision" (it reads images).
    capabilities: list[str] = []
    # A LoRA adapter's card: the base model's id, and where the adapter was loaded from.
    parent: str | None = None
    root: str | None = None
    # On a server of several models: "loaded", "loading" or "unloaded", and the other
    # names (and name patterns) that pick this model.
    state: str | None = None
    aliases: list[str] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
