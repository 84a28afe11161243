"""The vision tower's outputs by image, kept between the prompt chunks that read them: the
runner's side of the encoder cache group (scheduler.cache_groups.encoder_cache).

The group decides, in embedding rows, what sits here and when the tower runs; each step's
`EncoderPlan` says which features to drop and which images to encode before the forward
(the chunk that first needs an image encodes it; later chunks and the same picture in another
request read it here). The group's rows come from the memory plan's share for it
(`ENCODER_CACHE_BYTES`, `encoder_cache_rows`). It counts the images the tower ran for and
the wall time the tower took (`stats`), for /metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import mlx.core as mx

from metal_engine.outputs import EncoderStats
from scheduler.media import ImageSpan
from scheduler.output import EncoderPlan


class ImageFeatures(Protocol):
    """What the tower gives one image: its embeddings in the text model's width (one row per
    placeholder token) and, for Qwen3-VL, the deepstack features added after early layers."""

    embeds: mx.array
    deepstack: tuple[mx.array, ...]


# The memory plan's share for the tower's outputs: ~100 screenshots of a 30B model's width
# (2k tokens each).
ENCODER_CACHE_BYTES = 256 * 2**20

Encode = Callable[[Sequence[ImageSpan]], list[ImageFeatures]]


def encoder_cache_rows(row_bytes: int, budget_bytes: int = ENCODER_CACHE_BYTES) -> int:
    """The embedding rows (`row_bytes` each: the text model's width in the run dtype, times
    the feature maps a row carries) that `budget_bytes` of the memory plan hold."""
    return max(budget_bytes // row_bytes, 1)


class EncoderCache:
    def __init__(self, encode: Encode) -> None:
        """`encode`: the tower over several images at once, their features in order."""
        self._encode = encode
        self._features: dict[str, ImageFeatures] = {}
        self.num_encoded = 0  # images the tower ran for
        self.encode_seconds = 0.0  # the tower's wall time for them

    def stats(self) -> EncoderStats:
        return EncoderStats(self.num_encoded, self.encode_seconds)

    def apply(self, plan: EncoderPlan) -> None:
        """Drop the features the plan frees, then encode its images (in one batch)."""
        for content_hash in plan.free:
            self._features.pop(content_hash, None)
        if plan.encode:
            features = self._encoded(plan.encode)
            self._features.update(zip((i.content_hash for i in plan.encode), features,
                                      strict=True))

    def features(self, images: Sequence[ImageSpan]) -> list[ImageFeatures]:
        """Each image's features, which a plan up to this step encoded."""
        missing = [i.content_hash for i in images if i.content_hash not in self._features]
        if missing:
            raise RuntimeError(f"no encoder plan encoded images {missing}: the runner was "
                               "given a step its scheduler's encoder cache group did not plan")
        return [self._features[image.content_hash] for image in images]

    def clear(self) -> None:
        """Forget every image (a scheduler of its own ran steps on this runner: warm-up)."""
        self._features.clear()

    def _encoded(self, images: Sequence[ImageSpan]) -> list[ImageFeatures]:
        """The tower's features, evaluated here so that the time counted is the tower's own
        (the step that reads them would wait for them anyway)."""
        start = time.perf_counter()
        features = self._encode(images)
        mx.eval([(f.embeds, *f.deepstack) for f in features])
        self.encode_seconds += time.perf_counter() - start
        self.num_encoded += len(images)
        return features
