"""Per-request generation parameters, validated once at the API edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

MAX_LOGPROBS = 20


# Far past any useful value (1.1-1.5 is typical); bounds the logits it divides or multiplies.
MAX_REPETITION_PENALTY = 100.0
# Below this a temperature samples greedily (as in vLLM): dividing by it would overflow float32.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output to JSON: matching `json_schema` (a JSON schema as text), or any
    JSON object when it is None."""

    json_schema: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    `temperature == 0` means greedy, and so does any temperature below
    GREEDY_BELOW_TEMPERATURE (dividing by it would overflow float32). `top_k <= 0`,
    `top_p == 1` and `min_p == 0` disable those filters; any top_p or min_p keeps at least the
    most likely token. `stop` strings are matched on the detokenized text by the engine's
    output processor; `stop_token_ids` and EOS are matched by the scheduler, and suppressed
    until `min_tokens` tokens are out. `logit_bias` pairs (token id, bias) are added to the
    logits before any sampling, greedy included (ids past the vocabulary are ignored); so are
    the penalties: `presence_penalty` and `frequency_penalty` (OpenAI) over the output tokens,
    `repetition_penalty` (divides positive logits, multiplies negative ones; below
    1 / MAX_REPETITION_PENALTY it acts as that bound) over prompt and output tokens.
    `logprobs = k` returns the sampled token's logprob and its top-k alternatives;
    `structured` constrains the output to a grammar. The detokenizer skips special tokens
    but `shown_special_ids`, which it writes as their text (the markup a chat format's
    parser reads, e.g. Mistral's `[TOOL_CALLS]`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = field(default=())
    shown_special_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        check_sampling_ranges(
            self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty
        )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -100 <= bias <= 100:
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and biases in [-100, 100], "
                    f"got {token_id}: {bias}"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"logprobs must be in [0, {MAX_LOGPROBS}] (or None for no logprobs), "
                f"got {self.logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens on the host (penalties, grammar)."""
        return self.has_penalties or self.structured is not None

    @cached_property
    def is_basic(self) -> bool:
        """Only temperature, top-k/top-p and seed: nothing the sampler builds per-row arrays
        for (the common case, which it can take a short path for)."""
        return not (
            self.needs_token_history or self.logit_bias or self.min_tokens or self.min_p
        )


def check_sampling_ranges(
    temperature: float, top_p: float, top_k: int, min_p: float, repetition_penalty: float
) -> None:
    """The ranges of the sampling knobs a request or a server default may set."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {min_p}")
    if not 0 < repetition_penalty <= MAX_REPETITION_PENALTY:
        raise ValueError(
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (1 disables it), "
            f"got {repetition_penalty}"
        )
