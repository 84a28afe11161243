"""The vision tower's outputs by image, kept between the prompt chunks that read them.

A chunked prefill may cut through an image's placeholder tokens: the chunk that first needs
the image encodes it, the next chunks take their rows from here. The same picture in another
request (an agent's next turn re-sends its screenshot) is encoded once while it stays. The
cache holds at most `budget_bytes`, least recently used out first; an image evicted between
two of its chunks is encoded again (the same output, at the tower's cost). It counts the
images the tower ran for and the wall time the tower took (`stats`), for /metrics.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import mlx.core as mx

from metal_engine.outputs import EncoderStats
from scheduler.media import ImageSpan


class ImageFeatures(Protocol):
    """What the tower gives one image: its embeddings in the text model's width (one row per
    placeholder token) and, for Qwen3-VL, the deepstack features added after early layers."""

    embeds: mx.array
    deepstack: tuple[mx.array, ...]


# What the tower's outputs may take: ~100 screenshots of a 30B model's width (2k tokens each).
ENCODER_CACHE_BYTES = 256 * 2**20

Encode = Callable[[Sequence[ImageSpan]], list[ImageFeatures]]


class EncoderCache:
    def __init__(self, encode: Encode, budget_bytes: int) -> None:
        """`encode`: the tower over several images at once, their features in order."""
        self._encode = encode
        self.budget_bytes = budget_bytes
        self._features: OrderedDict[str, ImageFeatures] = OrderedDict()
        self._bytes = 0
        self.num_encoded = 0  # images the tower ran for
        self.encode_seconds = 0.0  # the tower's wall time for them

    def stats(self) -> EncoderStats:
        return EncoderStats(self.num_encoded, self.encode_seconds)

    def features(self, images: Sequence[ImageSpan]) -> list[ImageFeatures]:
        """Each image's features: cached, or encoded now (the missing ones in one batch)."""
        missing = list({image.content_hash: image for image in images
                        if image.content_hash not in self._features}.values())
        found = dict(zip((image.content_hash for image in missing),
                         self._encoded(missing) if missing else [], strict=True))
        for image in images:
            if image.content_hash in self._features:
                self._features.move_to_end(image.content_hash)
                found.setdefault(image.content_hash, self._features[image.content_hash])
        for content_hash, features in found.items():
            self._keep(content_hash, features)
        return [found[image.content_hash] for image in images]

    def _encoded(self, images: Sequence[ImageSpan]) -> list[ImageFeatures]:
        """The tower's features, evaluated here so that the time counted is the tower's own
        (the step that reads them would wait for them anyway)."""
        start = time.perf_counter()
        features = self._encode(images)
        mx.eval([(f.embeds, *f.deepstack) for f in features])
        self.encode_seconds += time.perf_counter() - start
        self.num_encoded += len(images)
        return features

    def _keep(self, content_hash: str, features: ImageFeatures) -> None:
        if content_hash in self._features:
            return
        size = _nbytes(features)
        if size > self.budget_bytes:
            return  # used by this step only
        while self._bytes + size > self.budget_bytes:
            _, evicted = self._features.popitem(last=False)
            self._bytes -= _nbytes(evicted)
        self._features[content_hash] = features
        self._bytes += size

    @property
    def num_bytes(self) -> int:
        return self._bytes


def _nbytes(features: ImageFeatures) -> int:
    return features.embeds.nbytes + sum(d.nbytes for d in features.deepstack)
