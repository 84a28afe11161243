"""Text that is no Unicode: JSON's `"\\ud800"` escape decodes to a lone UTF-16 surrogate,
which no tokenizer takes and no response can encode. Requests are refused with a 400 naming
the field that holds one, before any work."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from server.http.errors import invalid_at


def lone_surrogate(data: Any) -> ValidationError | None:
    """The 400 for a request body (parsed JSON) whose text is no Unicode, naming the first
    string (or key) that holds a lone UTF-16 surrogate: JSON's `"\\ud800"` decodes to one,
    which no tokenizer or response encoder takes. None if every string encodes."""
    path = _surrogate_path(data, ())
    if path is None:
        return None
    return invalid_at((path, "holds a lone UTF-16 surrogate (e.g. \\ud800); send valid Unicode"))


def refuse_lone_surrogates(cls, data: Any) -> Any:
    """A request model's before-validator: the body as it is, or the 400 of `lone_surrogate`
    (use as `model_validator(mode="before")(refuse_lone_surrogates)`)."""
    if (refused := lone_surrogate(data)) is not None:
        raise refused
    return data


ESCAPED_SURROGATE = (
    "the JSON text escapes a lone UTF-16 surrogate (e.g. \\ud800); send valid Unicode"
)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def escapes_lone_surrogate(json_text: str) -> bool:
    """Whether JSON text (a tool call's arguments) escapes a lone UTF-16 surrogate, which
    the prompt would then hold once the text is parsed. Only text with such an escape is."""
    if not _SURROGATE_ESCAPE.search(json_text):
        return False
    try:
        value = json.loads(json_text)
    except ValueError:
        return False  # not JSON: it goes into the prompt as the text it is
    return _surrogate_path(value, ()) is not None


def _surrogate_path(value: Any, path: tuple[str | int, ...]) -> tuple[str | int, ...] | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, list):
        for index, item in enumerate(value):
            if (found := _surrogate_path(item, (*path, index))) is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            # A key is named as it encodes: the error body must encode too.
            where = (*path, str(key).encode("utf-8", "backslashreplace").decode())
            if (found := _surrogate_path(key, where) or _surrogate_path(item, where)) is not None:
                return found
    return None
