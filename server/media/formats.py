"""The image formats the server reads, by Pillow's name and by media type."""

from __future__ import annotations

# Pillow's format names; GIFs and animated WebPs are read as their first frame.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MEDIA_TYPES = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",  # not registered, but clients send it
    "image/webp": "WEBP",
    "image/gif": "GIF",
}
SUPPORTED = "PNG, JPEG, WebP and GIF"
