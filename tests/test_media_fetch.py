"""Image URLs fetched from a local http server: only from allowed hosts, redirects only
within the host, and a 400 naming the field for every failure (status, timeout, size)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator

import pytest
from image_files import data_url
from image_server import PNG, SLOW_S, serving_images

from server.http.errors import APIError
from server.media.images import ImageSource
from server.media.load import load_images
from server.media.options import MediaOptions

FIELD = "input[0].content[1].image_url"


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with serving_images() as url:
        yield url


ALLOWED = {"allowed_domains": frozenset({"127.0.0.1"})}


def fetch(url: str, **options):
    source = ImageSource(FIELD, url)
    return asyncio.run(load_images([source], MediaOptions(**options)))


def refusal(url: str, **options) -> str:
    with pytest.raises(APIError) as raised:
        fetch(url, **options)
    assert raised.value.status_code == 400 and raised.value.param == FIELD
    assert raised.value.message.startswith(f"{FIELD}: ")
    return raised.value.message


def test_an_allowed_host_is_fetched_as_the_same_picture(base):
    [fetched] = fetch(f"{base}/picture.png", **ALLOWED)
    [sent] = fetch(data_url(PNG))
    assert fetched.content_hash == sent.content_hash and fetched.image.size == (24, 16)
    assert fetch(f"{base}/picture.png", allow_urls=True)[0].content_hash == sent.content_hash


def test_hosts_not_allowed_are_not_fetched(base):
    message = refusal(f"{base}/picture.png")
    assert "does not fetch images from 127.0.0.1" in message
    assert "--allowed-media-domains 127.0.0.1" in message and "data URL" in message
    assert "from 127.0.0.1" in refusal(f"{base}/picture.png",
                                       allowed_domains=frozenset({"example.com"}))


def test_redirects_stay_within_the_host(base):
    assert fetch(f"{base}/moved", **ALLOWED)[0].image.size == (24, 16)
    message = refusal(f"{base}/moved-away", **ALLOWED)
    assert "redirects to another host (localhost)" in message
    assert "redirects more than 3 times" in refusal(f"{base}/loop", **ALLOWED)


@pytest.mark.parametrize("path", ["/big", "/big-unsized"])
def test_a_body_over_the_cap_is_cut_off(base, path):
    message = refusal(f"{base}{path}", max_image_bytes=len(PNG) + 100, **ALLOWED)
    assert f"at most {len(PNG) + 100} are read" in message


def test_an_error_status_and_a_slow_server_are_400s(base):
    assert "the server answered HTTP 404" in refusal(f"{base}/missing.png", **ALLOWED)
    started = time.monotonic()
    message = refusal(f"{base}/slow", fetch_timeout_s=0.3, **ALLOWED)
    assert time.monotonic() - started < SLOW_S
    assert f"fetching the image at '{base}/slow' failed: it took longer than 0.3 s" in message


def test_an_unreachable_host_is_a_400():
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: the connection is refused
        assert "failed" in refusal(f"http://127.0.0.1:{port}/x.png", **ALLOWED)
