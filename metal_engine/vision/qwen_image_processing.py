"""A still image as the Qwen vision tower reads it, computed as the checkpoint's image processor
(transformers' Qwen2VLImageProcessor, Pillow backend, used by Qwen2-VL through Qwen3.5) does:

1. RGB, transparency composited onto white;
2. resized (Pillow, the config's resample filter) to the size `smart_resize` picks: each side a
   multiple of patch x merge, the area within [min_pixels, max_pixels], the aspect kept;
3. scaled to [0, 1], normalized by the config's mean and std;
4. cut into patches, repeated `temporal_patch_size` times (a still image is a one-frame clip),
   ordered merge block by merge block so the merger's neighbours are adjacent rows:

   patch rows: (block_row, block_col, row_in_block, col_in_block), each row
               (channel, t, y, x) flattened -> [num_patches, C * T * P * P]

numpy and Pillow only. transformers' torchvision backend resizes with torch's own bicubic
kernel, which can differ from Pillow's by a few levels per pixel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from metal_engine.vision.features import ProcessedImage
from metal_engine.vision.pixels import IMAGE_PROCESSOR_CONFIG, read_image_processor_config, to_rgb

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class QwenImageProcessing:
    """The preprocessing options of a checkpoint's preprocessor_config.json."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"image min_pixels {self.min_pixels} and max_pixels "
                             f"{self.max_pixels} must satisfy 0 < min <= max")

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merge block of patches."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> QwenImageProcessing:
        """Read either spelling of the pixel bounds: `min_pixels` / `max_pixels` (older
        checkpoints; they win, as in transformers) or `size: {shortest_edge, longest_edge}`."""
        size = raw.get("size") or {}
        defaults = cls()
        min_pixels = raw.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
        max_pixels = raw.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        return cls(
            patch_size=raw.get("patch_size", defaults.patch_size),
            temporal_patch_size=raw.get("temporal_patch_size", defaults.temporal_patch_size),
            merge_size=raw.get("merge_size", defaults.merge_size),
            min_pixels=min_pixels or defaults.min_pixels,
            max_pixels=max_pixels or defaults.max_pixels,
            resample=raw.get("resample", defaults.resample),
            rescale_factor=raw.get("rescale_factor", defaults.rescale_factor),
            image_mean=tuple(raw.get("image_mean", defaults.image_mean)),
            image_std=tuple(raw.get("image_std", defaults.image_std)),
            do_resize=raw.get("do_resize", True),
            do_rescale=raw.get("do_rescale", True),
            do_normalize=raw.get("do_normalize", True),
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> QwenImageProcessing:
        settings = read_image_processor_config(model_dir)
        if not settings:
            raise FileNotFoundError(
                f"{model_dir} has no {IMAGE_PROCESSOR_CONFIG}, which says how images are "
                "resized and normalized for its vision tower: copy it from the original "
                "checkpoint")
        return cls.from_dict(settings)


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, scaled into [min_pixels, max_pixels]
    with the aspect ratio kept as well as the rounding allows."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise ValueError(f"image of {width}x{height} pixels: the aspect ratio must stay below "
                         f"{MAX_ASPECT_RATIO}; crop or pad it")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def patch_grid(height: int, width: int, options: QwenImageProcessing,
               min_pixels: int | None = None,
               max_pixels: int | None = None) -> tuple[int, int, int]:
    """The (t, h, w) patch grid an image of `height` x `width` pixels becomes; `min_pixels` /
    `max_pixels` override the checkpoint's bounds (a request's detail level)."""
    if options.do_resize:
        height, width = smart_resize(height, width, options.factor,
                                     min_pixels or options.min_pixels,
                                     max_pixels or options.max_pixels)
    return 1, height // options.patch_size, width // options.patch_size


def image_token_count(height: int, width: int, options: QwenImageProcessing,
                      min_pixels: int | None = None, max_pixels: int | None = None) -> int:
    """How many image tokens the prompt holds for such an image: one per merge block."""
    return math.prod(patch_grid(height, width, options, min_pixels, max_pixels)) // (
        options.merge_size ** 2)


def preprocess_image(image: Image.Image, options: QwenImageProcessing,
                     min_pixels: int | None = None,
                     max_pixels: int | None = None) -> ProcessedImage:
    """`image` as the tower's patches (see the module docstring)."""
    rgb = to_rgb(image)
    grid = patch_grid(rgb.height, rgb.width, options, min_pixels, max_pixels)
    if options.do_resize:
        size = (grid[2] * options.patch_size, grid[1] * options.patch_size)  # Pillow: (w, h)
        rgb = rgb.resize(size, resample=Image.Resampling(options.resample))
    pixels = np.asarray(rgb)
    if pixels.shape[0] % options.factor or pixels.shape[1] % options.factor:
        raise ValueError(f"image of {rgb.width}x{rgb.height} pixels without resizing: both "
                         f"sides must be multiples of {options.factor}")
    values = pixels.astype(np.float32)
    if options.do_rescale:  # in float64 first, as transformers rescales
        values = (pixels.astype(np.float64) * options.rescale_factor).astype(np.float32)
    if options.do_normalize:
        mean, std = (np.asarray(v, dtype=np.float32) for v in (options.image_mean,
                                                               options.image_std))
        values = (values - mean) / std
    return ProcessedImage(patchify(values.transpose(2, 0, 1), options), grid,
                          math.prod(grid) // options.merge_size ** 2)


def patchify(image: np.ndarray, options: QwenImageProcessing) -> np.ndarray:
    """A [C, H, W] image as [num_patches, C * T * P * P] rows in merge-block order, each patch
    repeated over the T temporal slots."""
    channels, height, width = image.shape
    p, m, t = options.patch_size, options.merge_size, options.temporal_patch_size
    blocks = image.reshape(channels, height // (p * m), m, p, width // (p * m), m, p)
    # -> (block_row, block_col, row_in_block, col_in_block, channel, y, x)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
    repeated = np.broadcast_to(blocks[:, :, :, :, :, None],
                               (*blocks.shape[:5], t, p, p))
    return np.ascontiguousarray(repeated.reshape(-1, channels * t * p * p), dtype=np.float32)
