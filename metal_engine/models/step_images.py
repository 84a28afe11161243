"""The image tokens of one packed step, as the text model takes them.

The vision tower turns each image into one embedding per image token (and, for Qwen3-VL's
deepstack, one more set per early decoder layer). A step carries those of the image tokens
it feeds: their packed rows, and their features in the same order. A chunked prefill whose
chunk cuts through an image carries that chunk's image rows only:

    packed rows:  | req0: t t I I I t | req1: t | req2: I I t |
    rows:                 2 3 4                   7 8
    embeds:               e e e                   e e          (one per row, in row order)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class StepImages:
    """`rows [n]` int32: the step's packed rows that are image tokens. `embeds [n, hidden]`:
    their features, in place of the token embeddings. `deepstack`: Qwen3-VL's features of
    earlier vision layers, each `[n, hidden]`; entry `i` is added to the rows' hidden states
    after decoder layer `i` (empty for families without deepstack)."""

    rows: mx.array
    embeds: mx.array
    deepstack: tuple[mx.array, ...] = ()

    def __post_init__(self) -> None:
        count = self.rows.shape[0]
        for name, features in [("embeds", self.embeds),
                               *((f"deepstack[{i}]", d) for i, d in enumerate(self.deepstack))]:
            if features.ndim != 2 or features.shape[0] != count:
                raise ValueError(f"{name} must be [{count}, hidden] (one row per image row), "
                                 f"got {list(features.shape)}")

    def placed(self, h: mx.array) -> mx.array:
        """Token embeddings `h [total_q, hidden]` with the image rows' replaced by `embeds`."""
        h[self.rows] = self.embeds.astype(h.dtype)
        return h

    def after_layer(self, layer: int, h: mx.array) -> mx.array:
        """Hidden states after decoder layer `layer`, its deepstack features added (if any)."""
        if layer >= len(self.deepstack):
            return h
        return h.at[self.rows].add(self.deepstack[layer].astype(h.dtype))

    def stretches(self, layers: range) -> list[range]:
        """`layers` cut after each layer that adds deepstack features (by absolute index, so a
        pipeline stage's share of the layers cuts where the whole model does)."""
        cuts = [i + 1 for i in range(len(self.deepstack)) if layers.start < i + 1 < layers.stop]
        edges = [layers.start, *cuts, layers.stop]
        return [range(a, b) for a, b in itertools.pairwise(edges) if b > a]
