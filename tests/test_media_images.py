"""Images sent as data URLs: decoded from each supported format to RGB, hashed by their
pixels, and refused with a 400 naming the field for every limit and every bad file."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
from image_files import data_url, encoded, picture, png_claiming
from PIL import Image

from server.http.errors import APIError
from server.media.images import ImageSource
from server.media.load import load_images
from server.media.options import MediaOptions

FIELD = "messages[2].content[1].image_url"


def load(*urls: str, **options) -> list:
    sources = [ImageSource(f"{FIELD}[{i}]" if len(urls) > 1 else FIELD, url, "low")
               for i, url in enumerate(urls)]  # fmt: skip
    return asyncio.run(load_images(sources, MediaOptions(**options)))


def refusal(url: str, **options) -> str:
    with pytest.raises(APIError) as raised:
        load(url, **options)
    assert raised.value.status_code == 400 and raised.value.param == FIELD
    assert raised.value.message.startswith(f"{FIELD}: ")
    return raised.value.message


def pixels_of(image: Image.Image) -> np.ndarray:
    return np.asarray(image)


def colors(image: Image.Image) -> set[tuple[int, ...]]:
    return {tuple(pixel) for pixel in pixels_of(image).reshape(-1, 3).tolist()}


@pytest.mark.parametrize(("fmt", "media_type", "options"), [
    ("PNG", "image/png", {}),
    ("WEBP", "image/webp", {"lossless": True}),
    ("GIF", "image/gif", {}),
    ("JPEG", "image/jpeg", {"quality": 95}),
])  # fmt: skip
def test_each_format_decodes_to_rgb(fmt, media_type, options):
    source = picture((24, 16), "P" if fmt == "GIF" else "RGB")
    [image] = load(data_url(encoded(source, fmt, **options), media_type))
    assert image.field == FIELD and image.detail == "low"
    assert (image.image.mode, image.image.size) == ("RGB", (24, 16))
    pixels, expected = pixels_of(image.image), pixels_of(source.convert("RGB"))
    if fmt == "JPEG":  # lossy: close, not equal
        assert np.abs(pixels.astype(int) - expected).mean() < 8
    else:
        np.testing.assert_array_equal(pixels, expected)


def test_the_hash_is_of_the_pixels_not_the_file():
    png = encoded(picture(), "PNG")
    same = [load(data_url(png))[0],
            load(data_url(encoded(picture(), "WEBP", lossless=True), "image/webp"))[0],
            load(data_url(encoded(picture(), "PNG", compress_level=0)))[0]]  # fmt: skip
    assert len({image.content_hash for image in same}) == 1
    other = load(data_url(encoded(picture().rotate(90, expand=True), "PNG")))[0]
    assert other.content_hash != same[0].content_hash


def test_transparency_becomes_white_and_a_gif_is_its_first_frame():
    clear = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    [image] = load(data_url(encoded(clear, "PNG")))
    assert colors(image.image) == {(255, 255, 255)}
    frames = [Image.new("RGB", (4, 4), color) for color in ((0, 0, 255), (0, 255, 0))]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(gif)).n_frames == 2
    [image] = load(data_url(gif, "image/gif"))
    assert colors(image.image) == {(0, 0, 255)}


def test_an_exif_rotated_photo_comes_upright():
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    [image] = load(data_url(encoded(picture((24, 16)), "JPEG", exif=exif), "image/jpeg"))
    assert image.image.size == (16, 24)


@pytest.mark.parametrize(("data", "media_type"), [
    (encoded(picture(), "BMP"), "image/png"),
    (encoded(picture(), "TIFF"), "image/png"),
    (b'<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"/>', "image/png"),
    (b"plain text", ""),
])  # fmt: skip
def test_other_formats_are_refused_listing_the_supported_ones(data, media_type):
    assert "send PNG, JPEG, WebP and GIF images" in refusal(data_url(data, media_type))


@pytest.mark.parametrize("media_type", ["image/bmp", "image/svg+xml", "image/tiff"])
def test_other_media_types_are_refused_before_decoding(media_type):
    message = refusal(data_url(encoded(picture(), "PNG"), media_type))
    assert f"images of type '{media_type}' are not supported" in message


@pytest.mark.parametrize(("url", "fragment"), [
    ("data:image/png;base64,iVBORw0KGgo=!!", "not valid base64"),
    ("data:image/png;base64,ñ", "not valid base64"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64", "must be base64"),
    (data_url(encoded(picture(), "PNG")[:60]), "could not be decoded"),
])  # fmt: skip
def test_bad_data_is_refused(url, fragment):
    assert fragment in refusal(url)


def test_a_decompression_bomb_is_refused_from_its_header():
    # 1.6 GB of pixels once inflated, in a 70-byte file: refused by Pillow's own limit
    assert "too large; at most 25000000 pixels" in refusal(data_url(png_claiming(20000, 20000)))
    # Under Pillow's limit, over ours: the header's size is refused (decoding the file, which
    # holds 1 pixel, would fail with another message).
    message = refusal(data_url(png_claiming(6000, 6000)))
    assert "6000x6000 pixels; at most 25000000" in message and "--max-image-pixels" in message
    assert refusal(data_url(encoded(picture((30, 30)), "PNG")), max_image_pixels=899)
    assert load(data_url(encoded(picture((30, 30)), "PNG")), max_image_pixels=900)


def test_files_over_the_byte_cap_are_refused():
    png = encoded(picture((64, 64)), "PNG")
    message = refusal(data_url(png), max_image_bytes=len(png) - 1)
    assert f"{len(png)} bytes; at most {len(png) - 1}" in message and "--max-image-bytes" in message
    # Far over the cap: refused from the data URL's length, before decoding it.
    assert "at most 100 are read" in refusal(data_url(b"x" * 10_000), max_image_bytes=100)
    assert load(data_url(png), max_image_bytes=len(png))


def test_more_images_than_the_limit_are_refused_naming_the_first_one_over():
    url = data_url(encoded(picture(), "PNG"))
    assert len(load(url, url, max_images=2)) == 2
    with pytest.raises(APIError) as raised:
        load(url, url, url, max_images=2)
    assert raised.value.param == f"{FIELD}[2]"
    assert "holds 3 images; at most 2" in raised.value.message
    assert "--limit-mm-per-prompt" in raised.value.message


@pytest.mark.parametrize("url", ["x", "ftp://example.com/a.png", "file:///etc/passwd",
                                 "https://"])
def test_what_is_neither_a_data_url_nor_http_is_refused(url):
    assert "neither a data URL" in refusal(url, allow_urls=True)
