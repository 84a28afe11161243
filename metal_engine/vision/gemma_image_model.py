"""Gemma 3's and Gemma 4's vision side: where an image goes in the prompt, how closely it is
looked at, and that its tokens see each other in prefill (metal_engine.vision.gemma_text_side
says what the text model does with them).

    Gemma 3:  template `<start_of_image>`  ->  "\\n\\n" boi image x 256 eoi "\\n\\n"
    Gemma 4:  template `<|image|>`         ->  boi image x (up to its budget) eoi
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from tokenizers import Tokenizer

from metal_engine.loading.model_config import read_config_json
from metal_engine.vision.features import ProcessedImage
from metal_engine.vision.gemma3_processor import Gemma3ImageProcessor
from metal_engine.vision.gemma4_processor import SOFT_TOKEN_BUDGETS, Gemma4ImageProcessor
from metal_engine.vision.gemma_config import Gemma3VisionConfig, ImageTokens
from metal_engine.vision.gemma_loading import GemmaVisionTower, load_gemma_vision
from metal_engine.vision.gemma_text_side import bidirectional_layers
from metal_engine.vision.prompt_images import PlacedImages, PromptImage

Processor = Gemma3ImageProcessor | Gemma4ImageProcessor


class GemmaImageModel(PlacedImages):
    """`processors`: by a request's detail ("low", else "auto"), what makes the tower's input.
    `around`: tokens written before boi and after eoi (Gemma 3's "\\n\\n")."""

    def __init__(self, tower: GemmaVisionTower, processors: dict[str, Processor],
                 tokens: ImageTokens, placeholder_id: int, around: list[int],
                 whole_images: bool) -> None:
        self.tower = tower
        self.processors = processors
        self.tokens = tokens
        self.placeholder_id = placeholder_id
        self.around = around
        self.whole_images = whole_images

    def process(self, image: PromptImage) -> tuple[str, ProcessedImage]:
        """Gemma 4's "low" detail takes the smallest soft-token budget; Gemma 3 has one size.
        The key: the picture and the patch grid it was resized to."""
        processor = self.processors["low" if image.detail == "low" else "auto"]
        processed = processor(image.image)
        return f"{image.content_hash}:{processed.grid}", processed

    @property
    def max_image_tokens(self) -> int:
        """The most image tokens one image takes (Gemma 3's one size, Gemma 4's budget)."""
        processor = self.processors["auto"]
        return getattr(processor, "max_soft_tokens", None) or processor.num_tokens

    def expansion(self, num_tokens: int) -> tuple[list[int], int]:
        return [*self.around, *self.tokens.around(num_tokens), *self.around], len(self.around) + 1


def load_gemma_image_model(model_dir: Path, dtype: mx.Dtype) -> GemmaImageModel | None:
    """The dir's Gemma vision side; None when it has no Gemma tower."""
    tower = load_gemma_vision(model_dir, dtype)
    if tower is None:
        return None
    config, raw = tower.config, read_config_json(model_dir)
    whole = bidirectional_layers(raw) != "none"
    if isinstance(config, Gemma3VisionConfig):
        processor = Gemma3ImageProcessor.from_model_dir(model_dir, config)
        return GemmaImageModel(tower, {"low": processor, "auto": processor}, config.tokens,
                               config.tokens.boi_token_id, paragraph_break(model_dir), whole)
    own = Gemma4ImageProcessor.from_model_dir(model_dir, config)
    low = Gemma4ImageProcessor.from_model_dir(
        model_dir, config, max_soft_tokens=min(SOFT_TOKEN_BUDGETS[0], own.max_soft_tokens))
    return GemmaImageModel(tower, {"low": low, "auto": own}, config.tokens,
                           config.tokens.image_token_id, [], whole)


def paragraph_break(model_dir: Path) -> list[int]:
    """The ids of "\\n\\n", which Gemma 3's processor writes around each image."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json: Gemma 3's images need it to "
                         "write the line breaks around them")
    return Tokenizer.from_file(str(path)).encode("\n\n", add_special_tokens=False).ids
