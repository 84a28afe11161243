"""Gemma 4's image processor in numpy and Pillow, as transformers' Gemma4ImageProcessorPil:
each image resized, keeping its aspect ratio, to the largest size whose sides are multiples of
`pooling_kernel_size * patch_size` and that has at most `max_soft_tokens * k^2` patches;
rescaled to [0, 1] (the tower maps it to [-1, 1]); cut into patches in row-major order.

The soft-token budget `max_soft_tokens` (70, 140, 280, 560 or 1120) bounds the image's tokens:
an image becomes `(rows / k) * (cols / k)` tokens, fewer than the budget for most shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from metal_engine.vision.features import ProcessedImage
from metal_engine.vision.gemma_config import Gemma4VisionConfig
from metal_engine.vision.pixels import (
    normalized,
    read_image_processor_config,
    rescaled,
    resized,
    to_rgb,
)

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
BICUBIC = 3  # PIL's number for it, as preprocessor_config.json writes `resample`


@dataclass(frozen=True)
class Gemma4ImageProcessor:
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int = 280
    resample: int = BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)

    def __post_init__(self) -> None:
        if self.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ValueError(f"max_soft_tokens {self.max_soft_tokens} must be one of "
                             f"{SOFT_TOKEN_BUDGETS}")

    @classmethod
    def from_settings(cls, settings: dict[str, Any], config: Gemma4VisionConfig,
                      **overrides: Any) -> Gemma4ImageProcessor:
        """From the image processor's settings (`read_image_processor_config`), patch and
        kernel sizes defaulting to the encoder's; `overrides` (e.g. a request's
        `max_soft_tokens`) win."""
        known = ("max_soft_tokens", "resample", "do_rescale", "rescale_factor", "do_normalize")
        keep = {k: settings[k] for k in known if settings.get(k) is not None}
        for key in ("image_mean", "image_std"):
            if settings.get(key) is not None:
                keep[key] = tuple(settings[key])
        return cls(patch_size=settings.get("patch_size") or config.patch_size,
                   pooling_kernel_size=(settings.get("pooling_kernel_size")
                                        or config.pooling_kernel_size),
                   **{**keep, **overrides})

    @classmethod
    def from_model_dir(cls, model_dir: Path | str, config: Gemma4VisionConfig,
                       **overrides: Any) -> Gemma4ImageProcessor:
        return cls.from_settings(read_image_processor_config(model_dir), config, **overrides)

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the image is resized to."""
        max_patches = self.max_soft_tokens * self.pooling_kernel_size**2
        budget_px = max_patches * self.patch_size**2
        side = self.pooling_kernel_size * self.patch_size
        scale = math.sqrt(budget_px / (height * width))
        new_h = math.floor(scale * height / side) * side
        new_w = math.floor(scale * width / side) * side
        if new_h == 0 and new_w == 0:
            raise ValueError(f"image {height}x{width} rounds to 0x0: both sides below "
                             f"{side} pixels once scaled into the patch budget")
        # A very thin image keeps one row (or column) of kernels and as many as fit the other way.
        longest = self.max_soft_tokens * side
        if new_h == 0:
            new_h, new_w = side, min(width // height * side, longest)
        elif new_w == 0:
            new_h, new_w = min(height // width * side, longest), side
        if new_h * new_w > budget_px:
            raise ValueError(f"image {height}x{width} resized to {new_h}x{new_w} exceeds "
                             f"{max_patches} patches of {self.patch_size} pixels")
        return new_h, new_w

    def __call__(self, image: Image.Image) -> ProcessedImage:
        """`pixel_values` `[rows * cols, patch * patch * 3]` float32 (each patch's pixels
        row by row, channels last); `num_tokens`: `rows * cols / k^2`."""
        image = to_rgb(image)
        height, width = self.target_size(image.height, image.width)
        pixels = rescaled(resized(image, height, width, self.resample),
                          self.rescale_factor if self.do_rescale else 1.0)
        if self.do_normalize:
            pixels = normalized(pixels, list(self.image_mean), list(self.image_std))
        rows, cols = height // self.patch_size, width // self.patch_size
        return ProcessedImage(patches(pixels, self.patch_size), (rows, cols),
                              rows * cols // self.pooling_kernel_size**2)


def patches(pixels: np.ndarray, patch: int) -> np.ndarray:
    """`[3, H, W]` -> `[rows * cols, patch * patch * 3]`, patches row-major, each patch's
    pixels row-major with their channels last."""
    channels, height, width = pixels.shape
    grid = pixels.reshape(channels, height // patch, patch, width // patch, patch)
    return np.ascontiguousarray(grid.transpose(1, 3, 2, 4, 0)).reshape(
        (height // patch) * (width // patch), -1)
