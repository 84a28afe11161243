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
from scheduler.sampling_params import MAX_REPETITION_PENALTY, StructuredOutput
from server.http.errors import APIError
from server.openai.protocol_tools import ResponseFormat, Tool, ToolCall, ToolCallDelta, ToolChoice
from server.sampling_defaults import SAMPLING_KEYS, SamplingDefaults

# ---- requests -------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # on assistant messages
    tool_call_id: str | None = None  # on tool messages
    name: str | None = None

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
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # -1 is how vLLM-style clients spell "disabled"; 0 means the same here.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=MAX_REPETITION_PENALTY)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # vLLM's extension: EOS and stop strings are ignored until this many tokens are out.
    min_tokens: int = Field(default=0, ge=0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1)
    # vLLM's extension: lower values are admitted first under `--scheduling-policy priority`.
    priority: int = 0
    # vLLM's extension: prompts with different salts never share prefix-cache blocks, so a
    # client cannot learn from `cached_tokens` what others sent.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        """Alternatives per token to report (0: only the sampled token's); None: no logprobs."""
        raise NotImplementedError

    def _sampling_fields(self, defaults: SamplingDefaults) -> dict[str, float | int]:
        """Each of `defaults`' fields: the request's value where it sends one (an explicit
        0 or -1 top_k, 0 min_p included), else the default."""
        values = {
            name: getattr(defaults, name) if getattr(self, name) is None else getattr(self, name)
            for name in SAMPLING_KEYS
        }
        values["top_k"] = max(values["top_k"], 0)  # -1 and 0 both mean off
        return values

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """The biases by token id; keys that name one token twice ("5", "05") are refused,
        since their biases would add up past the API's range."""
        biases: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(
                    f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                    param="logit_bias",
                ) from None
            if token in biases:
                raise APIError(
                    f"logit_bias names token {token} more than once ({key!r})",
                    param="logit_bias",
                )
            biases[token] = float(bias)
        return tuple(biases.items())

    def sampling_params(
        self,
        max_tokens: int,
        structured: StructuredOutput | None,
        defaults: SamplingDefaults,
    ) -> SamplingParams:
        """The engine's parameters, with `max_tokens` already fitted to the context; the
        sampling fields the request leaves unset come from `defaults` (required: a caller
        that forgot the server's defaults would silently sample with neutral ones)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                **self._sampling_fields(defaults),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                seed=self.seed,
                stop=tuple(s for s in stop if s),
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logit_bias=self._logit_bias(),
                logprobs=self.num_logprobs(),
                structured=structured,
            )
        except ValueError as exc:
            raise APIError(str(exc)) from exc


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None  # 0..20, checked by server.http.limits
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise APIError("top_logprobs needs logprobs: true.", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def response_structure(self) -> StructuredOutput | None:
        return self.response_format.structured() if self.response_format else None


# One prompt (text or token ids) or a batch of them.
PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_GenerationRequest):
    prompt: PromptInput
    logprobs: int | None = None  # alternatives per token, checked by server.http.limits
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, prompt: PromptInput) -> PromptInput:
        if not prompt or any(p in ("", []) for p in (prompt if isinstance(prompt, list) else ())):
            raise ValueError("prompt must not be empty, nor hold an empty prompt")
        return prompt

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


# ---- responses ------------------------------------------------------------------------------

# Chat adds "tool_calls": the choice ended with calls for the client to run.
ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]


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
    sampling_defaults: dict[str, float | int] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
