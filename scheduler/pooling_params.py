"""What a pooling request (embeddings, rerank) returns instead of sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# "last": the last prompt token's hidden state (decoder embedding models, Qwen3-Embedding);
# "mean": the mean over every prompt token; "cls": the first token's (BERT-style).
PoolingKind = Literal["last", "mean", "cls"]
POOLING_KINDS: tuple[PoolingKind, ...] = ("last", "mean", "cls")


class PoolingRefused(ValueError):
    """An engine cannot pool a request as it asks; `param`: the request's field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class PoolingParams:
    """How one pooling request reduces its prompt's final hidden states to one vector.

    The vector is truncated to its first `dimensions` (Matryoshka), then L2-normalized if
    `normalize`. With `logit_token_ids` the request returns the model's head's outputs of
    those ids at the pooled row instead: a causal reranker's "yes" and "no" token logits at
    the last token, a cross-encoder's label score at the first.
    """

    kind: PoolingKind = "last"
    normalize: bool = True
    dimensions: int | None = None
    logit_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise ValueError(f"pooling must be one of {POOLING_KINDS}, got {self.kind!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")

    @property
    def reads_every_row(self) -> bool:
        """Whether the pooled vector needs the hidden state of every prompt token from the
        first on (mean, CLS): such a request computes its whole prompt, no cached prefix."""
        return self.kind != "last"
