"""Pictures for the vision workload: PNGs drawn from a seeded generator, so a run can be
repeated and every request's picture differs (the same one again would be an encoder-cache
and prefix-cache hit, not the work the benchmark measures)."""

from __future__ import annotations

import base64
import io
import random

import numpy as np
from PIL import Image

# Flat tiles of this many pixels, as a screenshot's panels and text lines are: the file stays
# a few tens of kilobytes where random pixels would take the full 3 bytes a pixel.
TILE = 16


def picture(size: tuple[int, int], rng: random.Random) -> Image.Image:
    """A `size` (width, height) RGB picture of randomly coloured tiles."""
    width, height = size
    generator = np.random.default_rng(rng.getrandbits(64))
    tiles = generator.integers(0, 256, (-(-height // TILE), -(-width // TILE), 3), np.uint8)
    pixels = tiles.repeat(TILE, axis=0).repeat(TILE, axis=1)[:height, :width]
    return Image.fromarray(pixels)


def picture_data_url(size: tuple[int, int], rng: random.Random) -> str:
    """`picture(size, rng)` as a PNG data URL, as a chat request's `image_url` carries it."""
    buffer = io.BytesIO()
    picture(size, rng).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
