"""Fetch an image from an http(s) URL, only where the server allows it, within limits.

A server that fetched any URL would let a client make it read internal addresses (SSRF), so
only the hosts of `--allowed-media-domains` are fetched, or any with `--allow-media-urls`.
Redirects are followed within the URL's own host only; the body is streamed and cut off past
`--max-image-bytes`; the whole fetch, redirects included, has `--media-fetch-timeout`.
"""

from __future__ import annotations

import asyncio

import httpx

from server.http.errors import APIError, clip
from server.media.data_url import too_many_bytes
from server.media.options import MAX_REDIRECTS, MediaOptions

_URL_QUOTE = 80  # characters of a URL quoted in an error


async def fetch_image(url: str, field: str, options: MediaOptions) -> bytes:
    """The body at `url`; a 400 naming `field` if the host is not allowed or the fetch fails
    (an error status, a timeout, a redirect to another host, a body over the cap)."""
    host = _allowed_host(url, field, options)
    try:
        return await asyncio.wait_for(_get(url, host, field, options), options.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise _failed(field, url, f"it took longer than {options.fetch_timeout_s:g} s") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL: a redirect's Location
        raise _failed(field, url, str(exc) or type(exc).__name__) from None


def _allowed_host(url: str, field: str, options: MediaOptions) -> str:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise APIError(f"{field}: {clip(url, _URL_QUOTE)!r} is not a URL ({exc}).",
                       param=field) from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise APIError(
            f"{field}: {clip(url, _URL_QUOTE)!r} is neither a data URL "
            "(data:image/png;base64,...) nor an http(s) URL.",
            param=field,
        )
    if not options.fetches_from(parsed.host):
        raise APIError(
            f"{field}: this server does not fetch images from {parsed.host}; send the image as "
            "a data URL (data:image/png;base64,...), or start the server with "
            f"--allowed-media-domains {parsed.host} (or --allow-media-urls for any host).",
            param=field,
        )
    return parsed.host


async def _get(url: str, host: str, field: str, options: MediaOptions) -> bytes:
    # No timeout per connect or read: the whole fetch's deadline is `fetch_image`'s.
    async with httpx.AsyncClient(follow_redirects=False, timeout=None) as client:
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", url) as response:
                if not response.is_redirect:
                    return await _body(response, url, field, options.max_image_bytes)
                target = response.url.join(response.headers.get("location", ""))
            if target.host != host:
                raise _failed(field, url, f"it redirects to another host ({target.host}); "
                              f"only redirects within {host} are followed")
            url = str(target)
    raise _failed(field, url, f"it redirects more than {MAX_REDIRECTS} times")


async def _body(response: httpx.Response, url: str, field: str, max_bytes: int) -> bytes:
    if response.status_code != 200:
        raise _failed(field, url, f"the server answered HTTP {response.status_code}")
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_many_bytes(field, max_bytes, int(length))
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise too_many_bytes(field, max_bytes)
    return bytes(body)


def _failed(field: str, url: str, why: str) -> APIError:
    return APIError(f"{field}: fetching the image at {clip(url, _URL_QUOTE)!r} failed: {why}.",
                    param=field)
