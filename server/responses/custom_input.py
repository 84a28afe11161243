"""A custom tool call's free-form input, read out of the `{"input": "..."}` arguments the model
writes (custom tools are offered to the model as functions with one string argument).

While the arguments come in fragments, `InputStream` decodes the string as far as it is
written, so the input streams as the model writes it:

    arguments:  {"input": "*** Begin Patch\n*** Add Fi
                          └── decoded so far ─────────┘  (an escape cut in half waits)
"""

from __future__ import annotations

import json
import re

_DECODER = json.JSONDecoder(strict=False)  # models write raw newlines inside strings too
_OPENING = re.compile(r'\s*\{\s*"input"\s*:\s*"')
_HEX = frozenset("0123456789abcdefABCDEF")


def arguments_of(text: str) -> str:
    """The arguments of a custom tool's call whose input is `text`, as the model writes them."""
    return json.dumps({"input": text}, ensure_ascii=False)


def input_of(arguments: str) -> str:
    """The input of a call's complete arguments; the arguments' own text if they are not
    `{"input": <string>}` (the client then sees what the model wrote)."""
    try:
        value = _DECODER.decode(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


class InputStream:
    """Decodes the `input` string of arguments that arrive in fragments."""

    def __init__(self) -> None:
        self._arguments = ""
        self._position: int | None = None  # where the undecoded rest of the string starts
        self._ended = False  # the string's closing quote came, or it cannot be decoded

    def feed(self, fragment: str) -> str:
        """The input text that `fragment` completes (maybe none)."""
        self._arguments += fragment
        if self._ended:
            return ""
        if self._position is None:
            match = _OPENING.match(self._arguments)
            if match is None:
                # Not `{"input": "` (yet): give up once the text can no longer become it.
                self._ended = len(self._arguments.lstrip()) > 32
                return ""
            self._position = match.end()
        end = self._decodable_end(self._position)
        piece = self._arguments[self._position : end]
        self._position = end
        try:
            return _DECODER.decode(f'"{piece}"')
        except ValueError:  # an invalid escape: the input comes whole at the end
            self._ended = True
            return ""

    def _decodable_end(self, start: int) -> int:
        """The end of the string's text from `start` that decodes on its own: it stops before
        the closing quote or an escape still cut off (a surrogate pair counts as one)."""
        text, i = self._arguments, start
        while i < len(text):
            char = text[i]
            if char == '"':
                self._ended = True
                return i
            if char != "\\":
                i += 1
                continue
            length = _escape_length(text, i)
            if length is None:
                return i
            i += length
        return i


def _escape_length(text: str, i: int) -> int | None:
    """The length of the escape at `text[i]` (a backslash), or None while it is incomplete."""
    if i + 1 >= len(text):
        return None
    if text[i + 1] != "u":
        return 2
    code = text[i + 2 : i + 6]
    if len(code) < 4 or not set(code) <= _HEX:
        return None if len(code) < 4 else 6  # an invalid \u escape fails when decoded
    if 0xD800 <= int(code, 16) < 0xDC00:  # a high surrogate: wait for its low half
        return 12 if len(text) >= i + 12 else None
    return 6
