"""Image files made with Pillow for the image-input tests: each format, data URLs, and a
PNG whose header claims more pixels than it holds."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image


def picture(size: tuple[int, int] = (24, 16), mode: str = "RGB") -> Image.Image:
    """A picture whose every pixel differs from its neighbours (a lossless round trip keeps
    them all)."""
    width, height = size
    image = Image.new("RGB", size)
    image.putdata([((7 * x) % 256, (11 * y) % 256, (x * y) % 256)
                   for y in range(height) for x in range(width)])  # fmt: skip
    return image.convert(mode)


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose IHDR says `width` x `height` (its CRC fixed): a decompression bomb's
    header, which a reader must refuse before inflating anything."""
    data = bytearray(encoded(Image.new("RGB", (1, 1)), "PNG"))
    # signature (8), IHDR length (4), "IHDR" (4), width and height (4 + 4), ..., CRC at 29
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)
