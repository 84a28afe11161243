"""Load a request's images: fetch or unpack each file, then decode it on a worker thread, so
that no image holds up the event loop (and every other stream with it)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from server.http.errors import APIError
from server.media.data_url import data_url_bytes, is_data_url
from server.media.decode import decode_image
from server.media.fetch import fetch_image
from server.media.images import ImageInput, ImageSource
from server.media.options import MediaOptions


async def load_images(sources: Sequence[ImageSource], options: MediaOptions) -> list[ImageInput]:
    """The decoded images, in order; a 400 naming the field of the first one that is refused
    (over the per-request count, or see `data_url_bytes`, `fetch_image`, `decode_image`)."""
    if len(sources) > options.max_images:
        raise APIError(
            f"{sources[options.max_images].field}: the request holds {len(sources)} images; at "
            f"most {options.max_images} are read per request. Send fewer (or start the server "
            "with a higher --limit-mm-per-prompt).",
            param=sources[options.max_images].field,
        )
    # One at a time: at most `max_images`, and a refusal stops the rest from being fetched.
    return [await _load(source, options) for source in sources]


async def _load(source: ImageSource, options: MediaOptions) -> ImageInput:
    if is_data_url(source.url):
        return await asyncio.to_thread(_decode_data_url, source, options)
    data = await fetch_image(source.url, source.field, options)
    return await asyncio.to_thread(decode_image, data, source, options.max_image_pixels)


def _decode_data_url(source: ImageSource, options: MediaOptions) -> ImageInput:
    data = data_url_bytes(source.url, source.field, options.max_image_bytes)
    return decode_image(data, source, options.max_image_pixels)
