"""An image of a request: where it came from in the request, and once loaded, its pixels.

    ImageSource (an image part as sent) ──load_images──▶ ImageInput (decoded, hashed)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from PIL import Image

# How closely the model should look (OpenAI's `detail`): fewer image tokens for "low".
Detail = Literal["auto", "low", "high"]
DETAILS: tuple[Detail, ...] = ("auto", "low", "high")


@dataclass(frozen=True)
class ImageSource:
    """An image part as the request gave it, before anything is fetched or decoded.

    `field` is the caller's field it came from, which every error names
    (`messages[2].content[1].image_url`); `url` a data URL (base64) or an http(s) URL."""

    field: str
    url: str
    detail: Detail = "auto"


@dataclass(frozen=True)
class ImageInput:
    """A decoded image, in RGB, in the order the conversation shows it."""

    field: str
    image: Image.Image
    content_hash: str  # see `content_hash`
    detail: Detail


def content_hash(image: Image.Image) -> str:
    """blake2b of the decoded pixels with their size and mode. Pixels rather than the file's
    bytes: what the vision encoder computes depends on them alone, so one picture sent as a
    PNG, as a lossless WebP or with other metadata is one entry of the encoder's cache."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode} {image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
