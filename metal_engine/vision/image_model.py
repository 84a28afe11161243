"""A checkpoint's vision side as the engine and the server use it: its image processor, its
tower and where its images go in a prompt.

    server (prompt worker)                      engine (runner)
    place(ids, images) ─▶ ids, PromptMedia ─▶ add_request ─▶ encode(spans) ─▶ image rows

`place` runs where prompts are built, off the event loop: it preprocesses each image (numpy
and Pillow) and writes as many placeholder tokens as the tower gives it embeddings; `encode`
runs the tower on the engine's thread, for the images a step's chunks reach.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import mlx.core as mx
from PIL import Image

from metal_engine.loading.model_config import read_config_json
from metal_engine.models.mrope_positions import mrope_positions
from metal_engine.vision.features import ProcessedImage, VisionFeatures
from metal_engine.vision.qwen_image_processing import QwenImageProcessing, preprocess_image
from metal_engine.vision.qwen_vision import QwenVisionTower
from metal_engine.vision.qwen_vision_config import read_image_token_ids
from metal_engine.vision.qwen_vision_loading import load_vision_tower
from scheduler.media import ImageSpan, PromptMedia

# "low" detail (OpenAI's 512 x 512 thumbnail): at most this many image tokens.
LOW_DETAIL_TOKENS = 256


class PromptImage(Protocol):
    """A request's decoded image (server.media's ImageInput): its RGB pixels, their hash and
    how closely to look ("auto", "low" or "high")."""

    image: Image.Image
    content_hash: str
    detail: str


class QwenImageModel:
    """Qwen3-VL's and Qwen3.5's: `<|vision_start|><|image_pad|><|vision_end|>` in the
    template, the pad written once per merged patch, three-axis rope positions."""

    def __init__(self, tower: QwenVisionTower, processing: QwenImageProcessing,
                 image_token_id: int) -> None:
        self.tower = tower
        self.processing = processing
        self.image_token_id = image_token_id

    def process(self, image: PromptImage) -> tuple[str, ProcessedImage]:
        """The tower's input for `image` and its cache key (the picture and the pixel bounds
        it was resized within)."""
        options = self.processing
        max_pixels = options.max_pixels
        if image.detail == "low":
            max_pixels = min(max_pixels, LOW_DETAIL_TOKENS * options.factor ** 2)
        min_pixels = min(options.min_pixels, max_pixels)
        processed = preprocess_image(image.image, options, min_pixels, max_pixels)
        return f"{image.content_hash}:{min_pixels}-{max_pixels}", processed

    def place(self, token_ids: Sequence[int],
              images: Sequence[PromptImage]) -> tuple[list[int], PromptMedia]:
        """`token_ids` with each image's one placeholder (as the chat template writes it)
        repeated for each of its embeddings, and the prompt's media. ValueError if the
        placeholders and the images do not pair up."""
        pad = self.image_token_id
        slots = [i for i, token in enumerate(token_ids) if token == pad]
        if len(slots) != len(images):
            raise ValueError(f"the prompt shows {len(slots)} image placeholders for "
                             f"{len(images)} images")
        ids: list[int] = []
        spans = []
        previous = 0
        for slot, image in zip(slots, images, strict=True):
            key, processed = self.process(image)
            ids += token_ids[previous:slot]
            spans.append(ImageSpan(len(ids), processed.num_tokens, key, processed))
            ids += [pad] * processed.num_tokens
            previous = slot + 1
        ids += token_ids[previous:]
        positions = mrope_positions(ids, pad, [s.processed.grid for s in spans],
                                    self.processing.merge_size)
        return ids, PromptMedia(tuple(spans), positions)

    def encode(self, spans: Sequence[ImageSpan]) -> list[VisionFeatures]:
        """Each image's features, the images batched in one pass of the tower."""
        return self.tower.encode([span.processed for span in spans]).per_image()


ImageModel = QwenImageModel


def load_image_model(model_dir: Path, dtype: mx.Dtype) -> ImageModel | None:
    """The model dir's vision side, None for a checkpoint without a tower."""
    tower = load_vision_tower(model_dir, dtype)
    if tower is None:
        return None
    tokens = read_image_token_ids(read_config_json(model_dir))
    return QwenImageModel(tower, QwenImageProcessing.from_model_dir(model_dir), tokens.image)
