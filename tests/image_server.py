"""A local http server of image files for the image-URL tests: /picture.png, and paths that
go wrong in each way a fetch can (a redirect within the host and to another, a loop, a body
over a cap with and without its length, a slow answer, a 404)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from image_files import encoded, picture

PNG = encoded(picture(), "PNG")  # what /picture.png serves
SLOW_S = 2.0  # how long /slow waits before answering


class ImageHandler(BaseHTTPRequestHandler):
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


@contextlib.contextmanager
def serving_images() -> Iterator[str]:
    """The server's base URL (http://127.0.0.1:PORT) while it runs."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
