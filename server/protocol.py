"""Request and response shapes of the OpenAI chat and completions APIs (the subset we serve).

Unknown request fields are ignored: clients send many we have no use for.
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
)

from scheduler import SamplingParams
from scheduler.request import FinishReason
from server.errors import APIError

# ---- requests -------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The content as one string; only text parts are supported."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text":
                raise APIError(
                    f"Content parts of type {part.type!r} are not supported; "
                    "send text parts ({'type': 'text', 'text': ...}) only.",
                    param="messages",
                )
            if part.text is None:
                raise APIError("A text content part has no 'text' field.", param="messages")
            texts.append(part.text)
        return "".join(texts)


class _GenerationRequest(BaseModel):
    """Fields shared by chat and completion requests."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # -1 is how vLLM-style clients spell "disabled"; 0 means the same here.
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1)
    # vLLM's extension: lower values are admitted first under `--scheduling-policy priority`.
    priority: int = 0

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        try:
            return tuple((int(token), float(b)) for token, b in (self.logit_bias or {}).items())
        except ValueError:
            raise APIError(
                "logit_bias keys must be token ids (integers as strings)", param="logit_bias"
            ) from None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters, with `max_tokens` already fitted to the context."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=max(self.top_k or 0, 0),
                seed=self.seed,
                stop=tuple(s for s in stop if s),
                ignore_eos=self.ignore_eos,
                logit_bias=self._logit_bias(),
            )
        except ValueError as exc:
            raise APIError(str(exc)) from exc


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool | None) -> bool | None:
        if logprobs:
            raise ValueError("logprobs are not supported yet; omit the field or send false")
        return logprobs

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) and len(prompt) > 1:
            raise ValueError(
                f"a list of {len(prompt)} prompts is not supported yet; send one request per prompt"
            )
        if not prompt or prompt == [""]:
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: int | None) -> int | None:
        if logprobs is not None:
            raise ValueError("logprobs are not supported yet; omit the field")
        return logprobs


# ---- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """Only the fields a chunk carries: `{"content": "..."}`, or `{}` on the last chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
