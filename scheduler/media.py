"""A prompt's images as the scheduler and the runner see them. Plain data.

    prompt:  [ text ][ image 0: its placeholder tokens ][ text ][ image 1 ... ][ text ]
                    ^ offset, length                           ^ offset, length

The prompt already holds each image's placeholder tokens (as many as the vision tower gives
the image embeddings); the forward puts the tower's embeddings in their rows. A placeholder
token is the same id for every image, so the blocks an image's tokens occupy take its content
hash into their block hashes: the same picture in the next turn is a cache hit, two pictures
never share a block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image of a prompt: where its placeholder tokens sit and what the tower encodes."""

    offset: int  # index of its first placeholder token in the prompt
    length: int  # its placeholder tokens (= the embeddings the tower gives it)
    content_hash: str  # of the decoded picture and how it was preprocessed
    # The tower's input as the model's image processor made it (its pixels and patch grid,
    # metal_engine.vision.features.ProcessedImage): the scheduler only carries it.
    processed: Any

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class PromptMedia:
    """A prompt's images, in order, and the positions its model's rope takes for them.

    `positions`: for a model with multimodal rope (Qwen's M-RoPE), each token's (time,
    height, width) position, the prompt's and those after it
    (metal_engine.models.mrope_positions.MropePositions, the runner's to read); None for a
    model whose positions stay the tokens' indices.
    """

    images: tuple[ImageSpan, ...]
    positions: Any = None

    def block_keys(self, block_index: int, block_size: int) -> tuple[str, ...]:
        """Content hashes of the images whose tokens fall in block `block_index`."""
        start, end = block_index * block_size, (block_index + 1) * block_size
        return tuple(image.content_hash for image in self.images
                     if image.offset < end and image.end > start)

    def overlapping(self, start: int, end: int) -> list[ImageSpan]:
        """The images with placeholder tokens among prompt tokens `start .. end`."""
        return [image for image in self.images if image.offset < end and image.end > start]


def whole_image_chunk(media: PromptMedia | None, start: int, num_new: int) -> int:
    """The tokens of a chunk from `start` that end outside every image: a chunk that would
    end inside an image ends before it, and one that starts at or inside it takes it to its
    end (for a text model whose image tokens see each other, the whole image must be in the
    step). An image longer than what is left of the step's budget is so computed in one
    chunk, over the budget; the engine makes the budget hold the model's largest image."""
    if media is None:
        return num_new
    end = start + num_new
    for image in media.images:
        if image.offset < end < image.end:
            return image.offset - start if image.offset > start else image.end - start
    return num_new
