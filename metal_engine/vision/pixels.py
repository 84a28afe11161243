"""The image operations of transformers' PIL image processors, in numpy and Pillow only, so
serving never imports torch: RGB conversion, Pillow resizing, rescaling, normalizing, and
reading the processor settings a checkpoint ships."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# transformers writes the image processor's settings nested in processor_config.json (newer
# saves) or alone in preprocessor_config.json; it reads the nested ones first.
PROCESSOR_CONFIG = "processor_config.json"
IMAGE_PROCESSOR_CONFIG = "preprocessor_config.json"


def read_image_processor_config(model_dir: Path | str) -> dict[str, Any]:
    """The checkpoint's image processor settings; {} when it ships none."""
    nested = Path(model_dir) / PROCESSOR_CONFIG
    if nested.exists():
        settings = json.loads(nested.read_text(encoding="utf-8")).get("image_processor")
        if settings is not None:
            return settings
    alone = Path(model_dir) / IMAGE_PROCESSOR_CONFIG
    return json.loads(alone.read_text(encoding="utf-8")) if alone.exists() else {}


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB; transparent pixels over white, as transformers composites them."""
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")


def resized(image: Image.Image, height: int, width: int, resample: int) -> Image.Image:
    """Pillow's resize of the 8-bit image (transformers' PIL backend resizes uint8 images
    this way); no-op at the same size, as Pillow copies then."""
    return image.resize((width, height), resample=Image.Resampling(resample))


def rescaled(image: Image.Image, factor: float) -> np.ndarray:
    """`[3, H, W]` float32 of `pixel * factor`, the product taken in float64 as transformers
    does before its downcast."""
    channels_first = np.asarray(image).transpose(2, 0, 1)
    return (channels_first.astype(np.float64) * factor).astype(np.float32)


def normalized(pixels: np.ndarray, mean: list[float], std: list[float]) -> np.ndarray:
    """`(pixels - mean) / std` per channel of a `[3, H, W]` float32 image, in float32."""
    mean32 = np.asarray(mean, dtype=np.float32)[:, None, None]
    std32 = np.asarray(std, dtype=np.float32)[:, None, None]
    return (pixels - mean32) / std32
