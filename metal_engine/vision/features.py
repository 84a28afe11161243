"""What an image processor hands its tower, and what a tower hands the text model: plain
bundles shared by every vision family."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class ProcessedImage:
    """One image as its tower takes it.

    `pixel_values`: float32, in the family's layout (Gemma 3: `[3, H, W]`; Gemma 4: its
    patches `[rows * cols, 3 * patch * patch]`; Qwen: its patches in merge-block order
    `[frames * rows * cols, 3 * frames_per_patch * patch * patch]`). `grid`: (rows, cols) of
    patches, or (frames, rows, cols) for Qwen.
    `num_tokens`: how many image placeholder tokens (`image_token_id`) the prompt holds for
    it, which is how many rows of embeddings the tower returns for it."""

    pixel_values: np.ndarray
    grid: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class VisionFeatures:
    """A batch of images encoded for the text model. `embeds`: `[sum(num_tokens), text_hidden]`,
    the images' rows one after another in the order given. `deepstack`: extra per-layer
    features for families that add them to early decoder layers (Qwen3-VL; none for Gemma).
    `token_counts`: each image's share of the rows."""

    embeds: mx.array
    deepstack: tuple[mx.array, ...]
    token_counts: tuple[int, ...]

    def per_image(self) -> list[VisionFeatures]:
        """Each image's own rows."""
        bounds = [0, *itertools.accumulate(self.token_counts)]
        return [VisionFeatures(self.embeds[a:b], tuple(d[a:b] for d in self.deepstack), (b - a,))
                for a, b in itertools.pairwise(bounds)]
