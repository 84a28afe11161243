"""A checkpoint's vision side as the engine and the server use it: its image processor, its
tower and where its images go in a prompt.

    server (prompt worker)                      engine (runner)
    place(ids, images) ─▶ ids, PromptMedia ─▶ add_request ─▶ encode(spans) ─▶ image rows

`place` runs where prompts are built, off the event loop: it preprocesses each image (numpy
and Pillow) and writes as many placeholder tokens as the tower gives it embeddings; `encode`
runs the tower on the engine's thread, for the images a step's chunks reach (both shared by
the families: vision/prompt_images.py; Gemma's: vision/gemma_image_model.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from metal_engine.loading.model_config import read_config_json
from metal_engine.loading.weight_bytes import safetensors_headers
from metal_engine.loading.weights import safetensors_files
from metal_engine.models.mrope_positions import mrope_positions
from metal_engine.vision.encoder_cache import ENCODER_CACHE_BYTES
from metal_engine.vision.features import ProcessedImage
from metal_engine.vision.gemma_config import read_gemma_vision
from metal_engine.vision.gemma_image_model import GemmaImageModel, load_gemma_image_model
from metal_engine.vision.gemma_loading import tower_name as gemma_tower_name
from metal_engine.vision.prompt_images import PlacedImages, PromptImage
from metal_engine.vision.qwen_image_processing import QwenImageProcessing, preprocess_image
from metal_engine.vision.qwen_vision import QwenVisionTower
from metal_engine.vision.qwen_vision_config import read_image_token_ids, read_vision_config
from metal_engine.vision.qwen_vision_loading import load_vision_tower
from metal_engine.vision.qwen_vision_loading import tower_name as qwen_tower_name
from scheduler.media import ImageSpan

if TYPE_CHECKING:
    from metal_engine.config import EngineConfig

# "low" detail (OpenAI's 512 x 512 thumbnail): at most this many image tokens.
LOW_DETAIL_TOKENS = 256


class QwenImageModel(PlacedImages):
    """Qwen3-VL's and Qwen3.5's: `<|vision_start|><|image_pad|><|vision_end|>` in the
    template, the pad written once per merged patch, three-axis rope positions."""

    def __init__(self, tower: QwenVisionTower, processing: QwenImageProcessing,
                 image_token_id: int) -> None:
        self.tower = tower
        self.processing = processing
        self.placeholder_id = image_token_id

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

    @property
    def feature_maps(self) -> int:
        """The embeddings and Qwen3-VL's deepstack features, each an image token's row."""
        return 1 + len(self.tower.config.deepstack_layers)

    def expansion(self, num_tokens: int) -> tuple[list[int], int]:
        """The pad, once per embedding."""
        return [self.placeholder_id] * num_tokens, 0

    def positions(self, token_ids: list[int], spans: list[ImageSpan]) -> Any:
        return mrope_positions(token_ids, self.placeholder_id, [s.processed.grid for s in spans],
                               self.processing.merge_size)


ImageModel = QwenImageModel | GemmaImageModel


def load_image_model(model_dir: Path, dtype: mx.Dtype) -> ImageModel | None:
    """The model dir's vision side, by its family; None for a checkpoint without a tower."""
    gemma = load_gemma_image_model(model_dir, dtype)
    if gemma is not None:
        return gemma
    tower = load_vision_tower(model_dir, dtype)
    if tower is None:
        return None
    tokens = read_image_token_ids(read_config_json(model_dir))
    return QwenImageModel(tower, QwenImageProcessing.from_model_dir(model_dir), tokens.image)


def has_vision_tower(model_dir: Path) -> bool:
    """Whether `load_image_model` would find a tower, read from config.json and the tensors'
    names alone (no weight is loaded)."""
    raw = read_config_json(model_dir)
    if read_gemma_vision(raw) is None and read_vision_config(raw) is None:
        return False
    names = safetensors_headers(safetensors_files(model_dir))
    return any(qwen_tower_name(n) or gemma_tower_name(n) for n in names)


def encoder_cache_bytes(config: EngineConfig) -> int:
    """What the memory plan sets aside for the tower's outputs: `--encoder-cache-memory`
    (default ENCODER_CACHE_BYTES) where the model dir holds a vision tower, else 0."""
    if not (config.model_dir / "config.json").is_file() or not has_vision_tower(config.model_dir):
        return 0
    return config.encoder_cache_memory or ENCODER_CACHE_BYTES
