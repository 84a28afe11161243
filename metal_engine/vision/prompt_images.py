"""What every family's vision side shares: a request's decoded image as it arrives, and
placing images in a prompt, which the families differ in only by what they write for an image
and how they preprocess it.

    template:  [ text ][ placeholder ][ text ]
    placed:    [ text ][ before.. image x num_tokens ..after ][ text ]
                                ^ ImageSpan: the tower's rows go here
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from PIL import Image

from metal_engine.vision.features import ProcessedImage, VisionFeatures
from scheduler.media import ImageSpan, PromptMedia


class PromptImage(Protocol):
    """A request's decoded image (server.media's ImageInput): its RGB pixels, their hash and
    how closely to look ("auto", "low" or "high")."""

    image: Image.Image
    content_hash: str
    detail: str


class Tower(Protocol):
    def encode(self, images: Sequence[ProcessedImage]) -> VisionFeatures: ...


class PlacedImages:
    """`place` and `encode` over a family's `process` and `expansion`.

    `placeholder_id`: the token the chat template writes where an image goes.
    `whole_images`: whether the text model lets an image's tokens see each other in prefill
    (then a prefill chunk must hold each image whole: scheduler.media.whole_image_chunk, and
    the family says its `max_image_tokens`)."""

    placeholder_id: int
    tower: Tower
    whole_images: bool = False
    feature_maps: int = 1  # what the tower gives each image token (Qwen3-VL: + deepstack)

    def process(self, image: PromptImage) -> tuple[str, ProcessedImage]:
        """The tower's input for `image` and its cache key (the picture and how it was
        preprocessed)."""
        raise NotImplementedError

    def expansion(self, num_tokens: int) -> tuple[list[int], int]:
        """The tokens an image of `num_tokens` embeddings replaces its placeholder with, and
        the index among them of its first image token."""
        raise NotImplementedError

    def positions(self, token_ids: list[int], spans: list[ImageSpan]) -> Any:
        """The placed prompt's rope positions where they are not the tokens' indices
        (PromptMedia.positions); None by default."""
        return None

    def place(self, token_ids: Sequence[int],
              images: Sequence[PromptImage]) -> tuple[list[int], PromptMedia]:
        """`token_ids` with each image's placeholder (as the chat template writes it)
        expanded to the image's tokens, and the prompt's media. ValueError if the
        placeholders and the images do not pair up."""
        slots = [i for i, token in enumerate(token_ids) if token == self.placeholder_id]
        if len(slots) != len(images):
            raise ValueError(f"the prompt shows {len(slots)} image placeholders for "
                             f"{len(images)} images")
        ids: list[int] = []
        spans = []
        previous = 0
        for slot, image in zip(slots, images, strict=True):
            key, processed = self.process(image)
            ids += token_ids[previous:slot]
            tokens, first = self.expansion(processed.num_tokens)
            spans.append(ImageSpan(len(ids) + first, processed.num_tokens, key, processed))
            ids += tokens
            previous = slot + 1
        ids += token_ids[previous:]
        return ids, PromptMedia(tuple(spans), self.positions(ids, spans))

    def encode(self, spans: Sequence[ImageSpan]) -> list[VisionFeatures]:
        """Each image's features, the images batched in one pass of the tower."""
        return self.tower.encode([span.processed for span in spans]).per_image()
