"""One choice's text, delta by delta, split into content and tool calls whose arguments stream
as the model writes them; the family's syntax comes from a `ToolParser`.

    deltas:  "Sure." "<tool_call>" '{"name": "f", "argu' 'ments": {"a": 1' '}}</tool_call>'
    content: "Sure."
    pieces:                         CallPiece(0, "f", '{"a": 1')  CallPiece(0, None, '}', done)

Each delta costs about its own length while a call's arguments stream: the region is parsed
again only when a delta could end a call (a `}` or the family's closing tag).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from partial_json_parser import Allow

from server.core.tool_parsers import ParsedCall, ToolParser, arguments_start, partial_json


@dataclass(frozen=True)
class CallPiece:
    """What one delta adds to the call at `index`: its name on the call's first piece, the
    next fragment of its arguments, and `done` on the piece that ends it. A call that ended
    without being complete (the text stopped inside it, or it was malformed after it began
    streaming) has `complete` False: its arguments are what was written, not a whole object."""

    index: int
    name: str | None
    arguments: str
    done: bool = False
    complete: bool = True


class _ObjectEnd:
    """Finds where a JSON object being written closes, reading each character once."""

    def __init__(self) -> None:
        self.scanned = 0  # characters read, from the object's `{`
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.length: int | None = None  # the object's length, once it closed

    def feed(self, chunk: str) -> int | None:
        """Read the object's next characters; its length once it closed."""
        for char in chunk:
            if self.length is not None:
                break
            self.scanned += 1
            if self.in_string:
                self.escaped = not self.escaped and char == "\\"
                self.in_string = self.escaped or char != '"'
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.length = self.scanned
        return self.length


@dataclass
class _OpenCall:
    """A call whose name has come and whose arguments are streaming."""

    name: str
    arguments_start: int  # where its arguments object starts in the call's text
    sent: int = 0  # characters of its arguments streamed so far
    end: _ObjectEnd = field(default_factory=_ObjectEnd)
    # Once all of its text so far streamed: the model's text held back (which the next delta
    # continues); None while the next delta needs the region parsed again.
    held: str | None = None


class ToolCallStream:
    """Splits one choice's text, delta by delta, into content and tool calls.

    Text that may still become a tool call is held back, so raw call syntax never reaches
    the content. A call's arguments stream as they are written, once its name is known. A
    call the text ended inside ends incomplete with the arguments written so far, or is
    dropped if its name had not come; any other region that does not parse by the end is
    handed out as content.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_end = 0  # characters of `text` handed out as content
        self.region: int | None = None  # where the tool-call region starts, once known
        self.num_calls = 0  # calls ended so far
        self.open: _OpenCall | None = None

    def feed(self, delta: str, final: bool) -> tuple[str, list[CallPiece]]:
        """Add a delta; return the new content and what it adds to the calls."""
        self.text += delta
        if self.region is None:
            self.region = self.parser.region_start(self.text)
        if self.region is None:
            end = len(self.text) if final else self.parser.safe_end(self.text)
            return self._content_to(end), []
        content = self._content_to(self.region)
        fragment = None if final else self._plain_fragment(delta)
        if fragment is not None:
            assert self.open is not None
            self.open.end.feed(fragment)
            self.open.sent += len(fragment)
            return content, [CallPiece(self.num_calls, None, fragment)] if fragment else []
        region = self.text[self.region :]
        found = self.parser.calls(region, final)
        pieces = [self._end_call(call) for call in found.calls[self.num_calls :]]
        call_text = self.parser.open_call(region, found.end)
        piece = self._stream(call_text)
        pieces += [piece] if piece else []
        if self.open is not None and call_text is not None:
            call = self.open
            streamed = call.sent == len(call_text) - call.arguments_start
            call.held = self.parser.held_tail(region, found.end, call_text) if streamed else None
        if not final:
            return content, pieces
        if self.open is not None:
            pieces.append(self._end_call(None))
        elif self.parser.cut_off(region, found.end):
            pass  # a call cut before its name and arguments: nothing to run, no markup to show
        elif region[found.end :].strip():  # a malformed call is shown to the client, not lost
            content += region[found.end :]
        return content, pieces

    def _plain_fragment(self, delta: str) -> str | None:
        """What `delta` adds to the open call's arguments, without parsing the region again:
        None unless all the call's text so far streamed and `delta` can end nothing."""
        call = self.open
        if call is None or call.held is None or call.end.length is not None:
            return None
        plain = self.parser.plain_arguments(call.held + delta)
        if plain is None:
            return None
        fragment, call.held = plain
        return fragment

    def _stream(self, call_text: str | None) -> CallPiece | None:
        """The next piece of the call being written, if it has a new one."""
        if call_text is None:
            return None
        name = None
        if self.open is None:
            start = arguments_start(call_text)
            name = _complete_name(call_text[:start]) if start is not None else None
            if name is None or start is None:
                return None
            self.open = _OpenCall(name, start)
        call = self.open
        arguments = call_text[call.arguments_start :]
        length = call.end.feed(arguments[call.end.scanned :])
        fragment = arguments[call.sent : length]
        if not (fragment or name):
            return None
        call.sent += len(fragment)
        return CallPiece(self.num_calls, name, fragment)

    def _end_call(self, call: ParsedCall | None) -> CallPiece:
        """The piece that ends the next call: `call` whole, or the rest of the open one
        (nothing, and incomplete, when `call` is None: the text ended inside it)."""
        index, self.num_calls = self.num_calls, self.num_calls + 1
        if self.open is None:
            assert call is not None
            return CallPiece(index, call.name, call.arguments, done=True)
        sent, self.open = self.open.sent, None
        if call is None:
            return CallPiece(index, None, "", done=True, complete=False)
        return CallPiece(index, None, call.arguments[sent:], done=True)

    def _content_to(self, end: int) -> str:
        piece = self.text[self.content_end : end]
        self.content_end = max(self.content_end, end)
        return piece


def _complete_name(head_text: str) -> str | None:
    """The name in a call's text before its arguments (a partial string would be left out)."""
    head = partial_json(head_text, Allow.ALL & ~Allow.STR)
    name = head.get("name") if isinstance(head, dict) else None
    return name if isinstance(name, str) else None
