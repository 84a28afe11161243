"""The chat request every API hands to the core, and what it reports back: messages, sampling
fields, tools (chat_request_tools.py), usage. Its shape is the OpenAI chat API's, which the
OpenAI adapter serves as it is; the Anthropic and Responses adapters translate into it.

Unknown request fields are ignored: clients send many we have no use for. The fields we model
are checked as OpenAI checks them (docs/openai-api.md, "Validation"); a check that pydantic
cannot say with a field constraint raises `invalid_at`, so the 400 still names the field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from scheduler import SamplingParams
from scheduler.sampling_params import MAX_REPETITION_PENALTY, StructuredOutput
from server.core.chat_request_tools import ResponseFormat, Tool, ToolCall, ToolChoice
from server.http.errors import APIError, Problem, clip, invalid_at
from server.http.unicode import refuse_lone_surrogates
from server.media.images import Detail
from server.sampling_defaults import SAMPLING_KEYS, SamplingDefaults
from server.serve_args import MAX_N

# ---- requests -------------------------------------------------------------------------------

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1  # above every vocabulary; bounds what an error may quote
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")
_LOGIT_BIAS_RANGE = 100


def _quoted(values: list[str], most: int = 5) -> str:
    """The first `most` of `values`, each cut short and quoted, and how many more there are."""
    shown = ", ".join(repr(clip(value)) for value in values[:most])
    return shown + (f" (and {len(values) - most} more)" if len(values) > most else "")


class StreamOptions(BaseModel):
    include_usage: bool = False


class ImageURL(BaseModel):
    url: str  # a data URL (data:image/png;base64,...) or an http(s) URL
    detail: Detail = "auto"


class ContentPart(BaseModel):
    """A `text` part, or an `image_url` part (its `image_url` an object, or the URL alone)."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None

    @field_validator("image_url", mode="before")
    @classmethod
    def _bare_url(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value


# The roles whose messages must have content; an assistant message needs content or calls.
_CONTENT_REQUIRED = ("system", "developer", "user", "tool")
# Images are the user's, or a tool's output (a screenshot, a file it read).
_IMAGE_ROLES = ("user", "tool")
_PARTS = "{'type': 'text', 'text': ...} or {'type': 'image_url', 'image_url': {'url': ...}}"


class ChatMessage(BaseModel):
    """One message; the fields its role requires are checked (a tool message answers a call
    by `tool_call_id`). Which roles exist is the chat template's business, not checked here."""

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # on assistant messages
    tool_call_id: str | None = None  # on tool messages
    name: str | None = None
    # An earlier answer's reasoning, as this server returned it; harmony prompts (GPT-OSS)
    # keep it while its turn's tool calls run, chat templates leave it out.
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        problems = self._part_problems() + self._missing_fields()
        if problems:
            raise invalid_at(*problems)
        return self

    def _missing_fields(self) -> list[Problem]:
        has_content = self.content is not None and self.content != []
        missing: list[Problem] = []
        if self.role in _CONTENT_REQUIRED and not has_content:
            needs = f"a {self.role} message needs content (a string or text parts)"
            missing.append((("content",), needs))
        if self.role == "assistant" and not has_content and not self.tool_calls:
            missing.append((("content",), "an assistant message needs content or tool_calls"))
        if self.role == "tool" and self.tool_call_id is None:
            needs = "a tool message needs the tool_call_id of the call it answers"
            missing.append((("tool_call_id",), needs))
        if self.role == "function" and self.name is None:
            missing.append((("name",), "a function message needs the function's name"))
        return missing

    def _part_problems(self) -> list[Problem]:
        problems: list[Problem] = []
        for index, part in enumerate(self.parts()):
            if part.type == "text" and part.text is None:
                problems.append((("content", index, "text"), "a text part needs its text"))
            elif part.type == "image_url" and part.image_url is None:
                needs = "an image_url part needs its image_url ({'url': ...})"
                problems.append((("content", index, "image_url"), needs))
            elif part.type == "image_url" and self.role not in _IMAGE_ROLES:
                refused = f"images go in user messages (or tool results), not {self.role} ones"
                problems.append((("content", index, "type"), refused))
            elif part.type not in ("text", "image_url"):
                refused = f"content parts of type {clip(part.type)!r} are not supported"
                problems.append((("content", index, "type"), f"{refused}; send {_PARTS}"))
        return problems

    def parts(self) -> list[ContentPart]:
        """The content parts; none for string content."""
        return self.content if isinstance(self.content, list) else []

    def text(self) -> str:
        """The content's text as one string; image parts are left out."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)

    def template_content(self) -> str | list[dict[str, str]]:
        """The content as chat templates take it: one string, or with images, text parts and
        a `{"type": "image"}` part where each image is (how vision models' templates place
        the image's tokens)."""
        if not any(part.type == "image_url" for part in self.parts()):
            return self.text()
        return [
            {"type": "text", "text": part.text or ""} if part.type == "text" else {"type": "image"}
            for part in self.parts()
        ]


# Fields that OpenAI documents as nullable: null means "the default" rather than a 400.
_NULL_MEANS_DEFAULT = (
    "n", "stream", "echo", "parallel_tool_calls", "ignore_eos", "min_tokens", "priority",
)  # fmt: skip


class GenerationRequest(BaseModel):
    """Fields shared by chat and completion requests (the completions API's lives in
    server.openai.protocol)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # -1 is how vLLM-style clients spell "disabled"; 0 means the same here.
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=MAX_REPETITION_PENALTY)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None  # only with stream: true
    ignore_eos: bool = False
    # vLLM's extension: EOS and stop strings are ignored until this many tokens are out.
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    logit_bias: dict[str, float] | None = None
    # OpenAI allows up to 128; `--max-n` caps it (lower) in serving.
    n: int = Field(default=1, ge=1, le=MAX_N)
    # vLLM's extension: lower values are admitted first under `--scheduling-policy priority`.
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    # vLLM's extension: prompts with different salts never share prefix-cache blocks, so a
    # client cannot learn from `cached_tokens` what others sent.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    user: str | None = None  # unused, but OpenAI and vLLM refuse one that is not a string
    # Unused; OpenAI's limits: 16 pairs, keys of up to 64 characters, values of up to 512.
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16
    )

    _valid_unicode = model_validator(mode="before")(refuse_lone_surrogates)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in _NULL_MEANS_DEFAULT):
            return {k: v for k, v in data.items() if not (v is None and k in _NULL_MEANS_DEFAULT)}
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            refused = "only allowed with stream: true; drop stream_options or set stream"
            raise invalid_at((("stream_options",), refused))
        return self

    @field_validator("metadata")
    @classmethod
    def _metadata_keys(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        long = [key for key in metadata or () if len(key) > 64]
        if long:
            raise ValueError(f"keys are at most 64 characters; {clip(long[0])!r} is not")
        return metadata

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys_and_values(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        """Keys must be token ids (digits, naming each token once), values in [-100, 100];
        the error quotes the first few bad keys, each cut short."""
        if not bias:
            return bias
        not_ids = [k for k in bias if not _TOKEN_ID_KEY.fullmatch(k) or int(k) > MAX_TOKEN_ID]
        if not_ids:
            raise ValueError(
                "keys must be token ids (non-negative integers as strings, at most "
                f"{MAX_TOKEN_ID}); not token ids: {_quoted(not_ids)}"
            )
        limit = _LOGIT_BIAS_RANGE
        out_of_range = [key for key, value in bias.items() if not -limit <= value <= limit]
        if out_of_range:
            raise ValueError(
                f"biases must be in [-{limit}, {limit}]; out of range at keys: "
                + _quoted(out_of_range)
            )
        seen: dict[int, str] = {}
        for key in bias:
            if (first := seen.setdefault(int(key), key)) != key:
                raise ValueError(f"token {int(key)} is named twice ({first!r} and {key!r})")
        return bias

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
        """The biases by token id (validation made each key name one token once: "5" and
        "05" together would add up past the API's range)."""
        return tuple((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items())

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
        if self.min_tokens > max_tokens:
            raise APIError(
                f"min_tokens is {self.min_tokens} but at most {max_tokens} tokens can be "
                "generated (max_tokens, or what the context leaves); lower min_tokens.",
                param="min_tokens",
            )
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


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = None  # 0..20, checked by server.http.limits
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # How long GPT-OSS (harmony) models think: low, medium or high; other models ignore it.
    reasoning_effort: str | None = None
    # The caller's field of each image part, in order, where an API adapter translated the
    # request into this one (Anthropic's `messages[1].content[0].source`); see `image_parts`.
    _image_fields: list[str] | None = PrivateAttr(default=None)

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

    def image_parts(self) -> list[tuple[ChatMessage, ContentPart, str]]:
        """Each image part, in the order the conversation shows them, with its message and
        the field errors name: the translated request's (`name_images`), else this one's
        (`messages[2].content[1].image_url`)."""
        found = [
            (message, part, f"messages[{i}].content[{j}].image_url")
            for i, message in enumerate(self.messages)
            for j, part in enumerate(message.parts())
            if part.type == "image_url"
        ]
        if self._image_fields is None:
            return found
        return [(m, p, field) for (m, p, _), field in zip(found, self._image_fields, strict=True)]

    def name_images(self, fields: list[str]) -> None:
        """Name the image parts, in order, by the fields of the request this one translates."""
        count = sum(part.type == "image_url" for m in self.messages for part in m.parts())
        if len(fields) != count:
            raise ValueError(f"{len(fields)} image fields for {count} image parts")
        self._image_fields = list(fields)

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


# ---- what it reports back -------------------------------------------------------------------

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

