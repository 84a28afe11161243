"""Per-request generation parameters, validated once at the API edge."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` disable those filters.
    `stop` strings are matched on the detokenized text by the engine's output processor;
    `stop_token_ids` and EOS are matched by the scheduler. `logit_bias` pairs (token id, bias)
    are added to the logits before any sampling, greedy included.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -100 <= bias <= 100:
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and biases in [-100, 100], "
                    f"got {token_id}: {bias}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
