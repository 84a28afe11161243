"""Image URLs fetched from a local http server: only from allowed hosts, redirects only
within the host, and a 400 naming the field for every failure (status, timeout, size)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from image_files import data_url, encoded, picture

from server.http.errors import APIError
from server.media.images import ImageSource
from server.media.load import load_images
from server.media.options import MediaOptions

FIELD = "input[0].content[1].image_url"
PNG = encoded(picture(), "PNG")
SLOW_S = 2.0


class ImageHandler(BaseHTTPRequestHandler):
    """/picture.png, and paths that go wrong in each way a fetch can."""

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path == "/picture.png":
            self._send(200, PNG)
        elif self.path == "/moved":
            self._send(302, b"", location="/picture.png")
        elif self.path == "/moved-away":  # same server, another host name
            self._send(302, b"", location=f"http://localhost:{port}/picture.png")
        elif self.path == "/loop":
            self._send(302, b"", location="/loop")
        elif self.path == "/big":
            self._send(200, PNG + b"\0" * 4096)
        elif self.path == "/big-unsized":  # no Content-Length: the stream itself is cut off
            self.send_response(200)
            self.end_headers()
            self.wfile.write(PNG + b"\0" * 4096)
            self.close_connection = True
        elif self.path == "/slow":
            time.sleep(SLOW_S)
            self._send(200, PNG)
        else:
            self._send(404, b"not here")

    def _send(self, status: int, body: bytes, location: str | None = None) -> None:
        self.send_response(status)
        if location is not None:
            self.send_header("Location", location)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


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
