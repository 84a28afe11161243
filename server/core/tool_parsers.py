"""Tool calls parsed out of a model's text, one parser per chat-template family.

A parser answers two questions about a choice's text: where its tool-call region starts, and
which calls at the start of that region are complete. `ToolCallStream` builds streaming and
whole-message parsing on those answers, so both see the same calls:

    text:  "Let me look.<tool_call>{...}</tool_call><tool_call>{...
            └── content ─┘└──────────── region ───────────────────┘
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class RegionCalls:
    calls: list[ParsedCall]
    end: int  # characters of the region those calls take up


def _call_of(value: Any) -> ParsedCall | None:
    """A call from a decoded `{"name": ..., "arguments" | "parameters": {...}}`."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _skip_space(text: str, pos: int, also: str = "") -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] in also):
        pos += 1
    return pos


class ToolParser(ABC):
    """Finds tool calls in one family's syntax. Stateless: one instance serves every request."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # open a region anywhere in the text
    leading: ClassVar[str] = ""  # opens a region at the start of the text (spaces aside)
    template_hints: ClassVar[tuple[str, ...]] = ()  # chat-template text that picks this parser

    def region_start(self, text: str) -> int | None:
        if self.leading and text.lstrip().startswith(self.leading):
            return 0  # the spaces before belong to the region, not to the content
        return min((i for m in self.markers if (i := text.find(m)) >= 0), default=None)

    def safe_end(self, text: str) -> int:
        """How much of a text with no region yet is content for sure: a region may still
        open at the start (while only spaces came) or at a marker's partial prefix."""
        if self.leading and self.leading.startswith(text.lstrip()):
            return 0
        longest = max((len(m) for m in self.markers), default=0)
        for i in range(max(0, len(text) - longest + 1), len(text)):
            if any(m.startswith(text[i:]) for m in self.markers):
                return i
        return len(text)

    @abstractmethod
    def calls(self, region: str, final: bool) -> RegionCalls:
        """The complete calls at the start of `region`; `final` once no more text comes."""


class HermesParser(ToolParser):
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` per call."""

    name = "hermes"
    markers = ("<tool_call>",)
    template_hints = ("<tool_call>",)
    _close = "</tool_call>"

    def calls(self, region: str, final: bool) -> RegionCalls:
        calls, end = [], 0
        while True:
            start = _skip_space(region, end)
            if not region.startswith(self.markers[0], start):
                break
            body_start = start + len(self.markers[0])
            close = region.find(self._close, body_start)
            if close < 0 and not final:
                break
            # At the end of the text a missing close tag is forgiven.
            body_end = len(region) if close < 0 else close
            call = _call_of(_loads(region[body_start:body_end]))
            if call is None:
                break
            calls.append(call)
            end = len(region) if close < 0 else close + len(self._close)
        return RegionCalls(calls, end)


class Llama3JsonParser(ToolParser):
    """Llama 3: the message is `{"name": ..., "parameters": {...}}` (several joined by `;`),
    possibly after `<|python_tag|>`."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    leading = "{"
    template_hints = ("<|python_tag|>", '"parameters": dictionary of argument name')

    def calls(self, region: str, final: bool) -> RegionCalls:
        pos = len(self.markers[0]) if region.startswith(self.markers[0]) else 0
        calls, end = [], 0
        while True:
            try:
                value, stop = _JSON.raw_decode(region, _skip_space(region, pos, also=";"))
            except ValueError:
                break
            call = _call_of(value)
            if call is None:
                break
            calls.append(call)
            pos = end = stop
        return RegionCalls(calls, end)


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. `[TOOL_CALLS]` is a
    special token that detokenizing may drop, so a leading JSON array of calls counts too."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    leading = "[{"
    template_hints = ("[TOOL_CALLS]",)

    def calls(self, region: str, final: bool) -> RegionCalls:
        pos = len(self.markers[0]) if region.startswith(self.markers[0]) else 0
        try:
            value, stop = _JSON.raw_decode(region, _skip_space(region, pos))
        except ValueError:
            return RegionCalls([], 0)
        calls = [_call_of(item) for item in (value if isinstance(value, list) else [value])]
        if not calls or None in calls:
            return RegionCalls([], 0)
        return RegionCalls(calls, stop)


class ForcedCallParser(ToolParser):
    """The output of a call generated under the tool-call JSON schema: one bare
    `{"name": ..., "arguments": {...}}` object, whatever the model's family."""

    name = "forced"
    leading = "{"

    def calls(self, region: str, final: bool) -> RegionCalls:
        try:
            value, stop = _JSON.raw_decode(region, _skip_space(region, 0))
        except ValueError:
            return RegionCalls([], 0)
        call = _call_of(value)
        return RegionCalls([call], stop) if call else RegionCalls([], 0)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)
}


def parser_named(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[name]()


def parser_for_template(template: str) -> ToolParser | None:
    """The parser whose family's syntax the chat template mentions, if any."""
    for parser in PARSERS.values():
        if any(hint in template for hint in parser.template_hints):
            return parser()
    return None


class ToolCallStream:
    """Splits one choice's text, delta by delta, into content and complete tool calls.

    Text that may still become a tool call is held back, so raw call syntax never reaches
    the content. A region that does not parse by the end is handed out as content.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_end = 0  # characters of `text` handed out as content
        self.region: int | None = None  # where the tool-call region starts, once known
        self.num_calls = 0

    def feed(self, delta: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """Add a delta; return the new content and the calls completed by it."""
        self.text += delta
        if self.region is None:
            self.region = self.parser.region_start(self.text)
        if self.region is None:
            end = len(self.text) if final else self.parser.safe_end(self.text)
            return self._content_to(end), []
        content = self._content_to(self.region)
        found = self.parser.calls(self.text[self.region :], final)
        new_calls = found.calls[self.num_calls :]
        self.num_calls = len(found.calls)
        if final:
            leftover = self.text[self.region + found.end :]
            if leftover.strip():  # a malformed call is shown to the client, not lost
                content += leftover
        return content, new_calls

    def _content_to(self, end: int) -> str:
        piece = self.text[self.content_end : end]
        self.content_end = max(self.content_end, end)
        return piece
