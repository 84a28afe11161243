"""Decode an image file with Pillow, refusing what would be expensive before paying for it.

`Image.open` reads only the header: the size is checked there, so a small file that claims
a huge canvas (a decompression bomb) is refused before a pixel is decoded. Runs off the event
loop (`load.load_images`): decoding a large photo takes tens of milliseconds.
"""

from __future__ import annotations

import io

from PIL import Image, ImageOps, UnidentifiedImageError

from server.http.errors import APIError
from server.media.formats import FORMATS, SUPPORTED
from server.media.images import ImageInput, ImageSource, content_hash

# What transparent pixels become: vision models are trained on opaque RGB.
_BACKGROUND = (255, 255, 255)


def decode_image(data: bytes, source: ImageSource, max_pixels: int) -> ImageInput:
    """The first frame of `data` in RGB, upright as its EXIF orientation says; a 400 naming
    the source's field for an unsupported format, more than `max_pixels`, or a damaged file."""
    field = source.field
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise APIError(
            f"{field}: the image is not in a format this server reads; send {SUPPORTED} "
            "images.",
            param=field,
        ) from None
    except Image.DecompressionBombError:  # past Pillow's own limit, far above ours
        raise _too_many_pixels(field, None, max_pixels) from None
    except Exception as exc:  # a header that a format's reader cannot make sense of
        raise _undecodable(field, exc) from None
    if image.width * image.height > max_pixels:
        raise _too_many_pixels(field, image.size, max_pixels)
    try:
        rgb = _opaque_rgb(image)
    # Pillow's decoders refuse damaged data with many kinds of error (OSError, SyntaxError,
    # ValueError, struct.error, ...); each is the client's file, not the server, failing.
    except Exception as exc:
        raise _undecodable(field, exc) from None
    return ImageInput(field, rgb, content_hash(rgb), source.detail)


def _opaque_rgb(image: Image.Image) -> Image.Image:
    upright = ImageOps.exif_transpose(image)  # decodes the (first) frame
    if upright.mode == "RGB":
        return upright
    if "A" not in upright.getbands() and "transparency" not in upright.info:
        return upright.convert("RGB")
    rgba = upright.convert("RGBA")
    opaque = Image.new("RGBA", rgba.size, _BACKGROUND)
    opaque.alpha_composite(rgba)
    return opaque.convert("RGB")


def _undecodable(field: str, exc: Exception) -> APIError:
    return APIError(f"{field}: the image could not be decoded ({exc}).", param=field)


def _too_many_pixels(field: str, size: tuple[int, int] | None, max_pixels: int) -> APIError:
    shown = f"{size[0]}x{size[1]} pixels" if size else "too large"
    return APIError(
        f"{field}: the image is {shown}; at most {max_pixels} pixels (width x height) are "
        "read. Send a smaller image (or start the server with a higher --max-image-pixels).",
        param=field,
    )
