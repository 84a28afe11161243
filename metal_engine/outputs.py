"""What the engine hands back: after each step, per request with news; and its numbers."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import FinishReason
from scheduler.stats import SchedulerStats


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of one generated token and of the `k` most likely tokens at its position.

    These are the model's raw log-softmax, before logit bias, grammar mask, penalties,
    temperature or any filter (as vLLM reports by default): what the model thinks, not the
    distribution the token was drawn from. `top` is (token id, logprob) by descending logprob,
    empty when the request asked for k = 0.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """The delta of one request produced by one engine step.

    `new_text` is the newly decoded text (never a partial multi-byte character, never part of
    a stop string); `finish_reason` is set on the last output of a request, with `stop_string`
    naming the request's stop string that ended it, if one did, and `error` saying why it
    failed when the reason is "error" (a message for the client, quoting nothing it sent).
    `logprobs` has one entry per `new_token_ids` entry, or is None when the request did not
    ask for logprobs. With speculative decoding, `num_draft_tokens` counts the request's
    drafts verified so far and `num_accepted_tokens` those accepted. A pooling request has
    one output, its last, with its vector in `pooled` and no tokens.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    stop_string: str | None = None
    error: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EncoderStats:
    """The vision tower's work since the engine started: images encoded (an image found in
    the encoder cache is not counted again) and the wall time the tower took for them."""

    num_images: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class EngineStats(SchedulerStats):
    """The scheduler's numbers, what the pool stores (the model dtype's name, int8 or int4)
    and, for a model that reads images, its encoder's work. Plain data, taken on the engine
    thread between steps (`LLMEngine.stats`)."""

    kv_cache_dtype: str = ""
    encoder: EncoderStats | None = None  # None: the model reads no images
