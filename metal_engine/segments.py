"""A pair prompt's token types (BERT's segments: 0 for `[CLS] query [SEP]`, 1 for `document
[SEP]`) carried in its token ids' high bits, so the step's packed ids carry them with no field
of their own; an encoder's embedding splits them back off.

    id | (type << SEGMENT_SHIFT)        token ids stay below 2**30, the step's ids are int32
"""

from __future__ import annotations

import mlx.core as mx

SEGMENT_SHIFT = 30
_TOKEN_MASK = (1 << SEGMENT_SHIFT) - 1


def with_segments(token_ids: list[int], token_type_ids: list[int]) -> list[int]:
    """The ids of a pair prompt with each token's type in its high bits."""
    return [t | (s << SEGMENT_SHIFT) for t, s in zip(token_ids, token_type_ids, strict=True)]


def split_segments(ids: mx.array) -> tuple[mx.array, mx.array]:
    """(token ids, token types) of packed ids that may carry types."""
    return ids & _TOKEN_MASK, ids >> SEGMENT_SHIFT
