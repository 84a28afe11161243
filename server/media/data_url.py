"""The bytes of a base64 data URL (`data:image/png;base64,...`), checked before decoding:
its media type must be a format the server reads, its size within the cap."""

from __future__ import annotations

import base64

from server.http.errors import APIError, clip
from server.media.formats import MEDIA_TYPES, SUPPORTED


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def data_url_bytes(url: str, field: str, max_bytes: int) -> bytes:
    """The decoded payload; a 400 naming `field` for a URL that is not base64, of another
    media type, larger than `max_bytes` once decoded, or not valid base64."""
    header, comma, payload = url.partition(",")
    media_type, *parameters = header[len("data:"):].split(";")
    if not comma or "base64" not in (p.strip().lower() for p in parameters):
        raise APIError(
            f"{field}: a data URL must be base64: data:image/png;base64,<data>.", param=field
        )
    media_type = media_type.strip().lower()
    if media_type and media_type not in MEDIA_TYPES:
        raise APIError(
            f"{field}: images of type {clip(media_type)!r} are not supported; send {SUPPORTED} "
            "images.",
            param=field,
        )
    size = len(payload) * 3 // 4 - payload.count("=", -2)  # refused before decoding
    if size > max_bytes:
        raise too_many_bytes(field, max_bytes, size)
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError as exc:  # binascii.Error, or characters outside ASCII
        problem = f"{field}: the image data is not valid base64 ({exc})."
        raise APIError(problem, param=field) from None


def too_many_bytes(field: str, max_bytes: int, size: int | None = None) -> APIError:
    """The 400 for an image file over `max_bytes`; `size` where it is known."""
    shown = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
    return APIError(
        f"{field}: the image is {shown}; at most {max_bytes} are read. Send a "
        "smaller file (or start the server with a higher --max-image-bytes).",
        param=field,
    )
