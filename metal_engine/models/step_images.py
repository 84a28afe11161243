"""The rows of a packed step that hold image placeholder tokens, and what goes there."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class StepImages:
    rows: mx.array  # [n] int32: packed rows of image tokens
    embeds: mx.array  # [n, hidden]: their embeddings, in place of the tokens'
    deepstack: tuple[mx.array, ...] = ()  # [n, hidden] each, added after the first layers
