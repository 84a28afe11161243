"""Gemma 3's image processor in numpy and Pillow: every image resized to the encoder's one
square size, rescaled to [0, 1] and normalized per channel, as transformers'
Gemma3ImageProcessorPil does with the checkpoint's preprocessor_config.json.

Pan-and-scan (extra crops of very wide or tall images, each its own image in the prompt) is
off by default in transformers (`do_pan_and_scan` is null in Google's configs) and is not done
here: an image is always encoded whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from metal_engine.vision.features import ProcessedImage
from metal_engine.vision.gemma_config import Gemma3VisionConfig
from metal_engine.vision.pixels import (
    normalized,
    read_image_processor_config,
    rescaled,
    resized,
    to_rgb,
)

log = logging.getLogger("metal_serve")
BILINEAR = 2  # PIL's number for it, as preprocessor_config.json writes `resample`
HALF = (0.5, 0.5, 0.5)  # transformers' IMAGENET_STANDARD_MEAN and _STD


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    height: int
    width: int
    patch_size: int
    num_tokens: int
    resample: int = BILINEAR
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = HALF
    image_std: tuple[float, ...] = HALF

    @classmethod
    def from_settings(cls, settings: dict[str, Any],
                      config: Gemma3VisionConfig) -> Gemma3ImageProcessor:
        """From the image processor's settings (`read_image_processor_config`); the size
        defaults to the encoder's image size."""
        if settings.get("do_pan_and_scan"):
            log.warning("Gemma 3 pan-and-scan is on in the checkpoint's processor settings; "
                        "metal-serve encodes each image whole, without the extra crops")
        size = settings.get("size") or {}
        keep = {k: settings[k] for k in ("resample", "do_rescale", "rescale_factor",
                                         "do_normalize") if settings.get(k) is not None}
        return cls(height=size.get("height", config.vision.image_size),
                   width=size.get("width", config.vision.image_size),
                   patch_size=config.vision.patch_size, num_tokens=config.mm_tokens_per_image,
                   image_mean=tuple(settings.get("image_mean") or HALF),
                   image_std=tuple(settings.get("image_std") or HALF), **keep)

    @classmethod
    def from_model_dir(cls, model_dir: Path | str,
                       config: Gemma3VisionConfig) -> Gemma3ImageProcessor:
        return cls.from_settings(read_image_processor_config(model_dir), config)

    def __call__(self, image: Image.Image) -> ProcessedImage:
        """`pixel_values` `[3, height, width]` float32; `num_tokens`: mm_tokens_per_image."""
        image = resized(to_rgb(image), self.height, self.width, self.resample)
        pixels = rescaled(image, self.rescale_factor if self.do_rescale else 1.0)
        if self.do_normalize:
            pixels = normalized(pixels, list(self.image_mean), list(self.image_std))
        grid = (self.height // self.patch_size, self.width // self.patch_size)
        return ProcessedImage(pixels, grid, self.num_tokens)
