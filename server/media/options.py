"""What the server lets a request's images be: where they may be fetched from, and how large
and how many they may be. Built once from `metal-serve serve`'s flags."""

from __future__ import annotations

from dataclasses import dataclass, field

# Per request, as vLLM's --limit-mm-per-prompt: each image costs its decode and its tokens.
DEFAULT_MAX_IMAGES = 8
# A 24-megapixel camera photo (6000x4000) fits; decoded to RGB it takes 72 MB.
DEFAULT_MAX_IMAGE_PIXELS = 25_000_000
# OpenAI's cap on one image file.
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_FETCH_TIMEOUT_S = 10.0
# Redirects followed when fetching, each within the URL's own host.
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaOptions:
    """`allowed_domains`: hosts whose http(s) image URLs are fetched (exact names, lower
    case); `allow_urls`: fetch from any host. Neither: only data URLs are read.
    `max_images` per request; `max_image_pixels` (width x height, checked from the file's
    header before it is decoded) and `max_image_bytes` (the file) per image;
    `fetch_timeout_s` for a whole fetch, redirects included."""

    allowed_domains: frozenset[str] = field(default_factory=frozenset)
    allow_urls: bool = False
    max_images: int = DEFAULT_MAX_IMAGES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("max_image_pixels", "max_image_bytes", "fetch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_images < 0:
            raise ValueError(f"max_images must be 0 or more, got {self.max_images}")

    def fetches_from(self, host: str) -> bool:
        """Whether an image URL on `host` (lower case, as URLs are parsed) may be fetched."""
        return self.allow_urls or host in self.allowed_domains
