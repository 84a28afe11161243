"""Server-sent events from a streaming chat or completions response, as the client reads them."""

from __future__ import annotations

import json
from dataclasses import dataclass


class SSEDecoder:
    """Incremental: `feed` text as it arrives; get the `data` of each event it completes.

    Handles LF, CRLF and CR line ends, comment lines (`: ping`), multi-line data, and
    fields other than `data` (ignored).
    """

    def __init__(self) -> None:
        self._pending = ""
        self._data: list[str] = []

    def feed(self, text: str) -> list[str]:
        text = self._pending + text
        # A trailing CR may be the first half of a CRLF split across two reads.
        held = "\r" if text.endswith("\r") else ""
        text = text[: len(text) - len(held)]
        *lines, rest = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._pending = rest + held
        events = []
        for line in lines:
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[str]:
        """Events left when the stream ends without a final blank line."""
        events = self.feed("\n\n") if self._pending or self._data else []
        self._pending = ""
        return events

    def _line(self, line: str) -> str | None:
        if not line:
            event = "\n".join(self._data) if self._data else None
            self._data = []
            return event
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


@dataclass(frozen=True)
class StreamDelta:
    """What one event adds: generated text, the server's token counts, an error, or the end."""

    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    done: bool = False


def parse_event(data: str) -> StreamDelta:
    """One `data` payload of a chat-completion or completion stream."""
    if data.strip() == "[DONE]":
        return StreamDelta(done=True)
    try:
        payload = json.loads(data)
    except ValueError:
        return StreamDelta(error=f"the server sent an event that is not JSON: {data[:200]!r}")
    if not isinstance(payload, dict):
        return StreamDelta(error=f"the server sent an unexpected event: {data[:200]!r}")
    if payload.get("error"):
        return StreamDelta(error=f"the server reported an error: {_error_text(payload['error'])}")
    usage = payload.get("usage") or {}
    text = "".join(_choice_text(choice) for choice in payload.get("choices") or [])
    return StreamDelta(text=text, completion_tokens=usage.get("completion_tokens"),
                       prompt_tokens=usage.get("prompt_tokens"))


def _choice_text(choice: dict) -> str:
    # Chat streams carry `delta.content`; completion streams carry `text`.
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


def _error_text(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
