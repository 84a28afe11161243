"""Tool calls parsed out of a model's text, one parser per chat-template family.

A parser answers four questions about a choice's text: where its tool-call region starts,
which calls at the start of that region are complete, where the call still being written
begins, and whether the text ended inside a call. `ToolCallStream` (tool_call_stream.py)
builds streaming and whole-message parsing on those answers, and streams a call's arguments
as they are written:

    text:  "Let me look.<tool_call>{...}</tool_call><tool_call>{"name": "f", "arguments": {"a
            └── content ─┘└──────────── region ──────────────────────────────────────────┘
                          └── complete call ───────┘└── open call ──┘└─ its arguments ──┘

A call's `arguments` are the model's own text of its arguments object, so the fragments
streamed while it is written join to exactly the arguments of the complete call.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

# Not strict: models write raw newlines and tabs inside strings (code, file contents).
_JSON = json.JSONDecoder(strict=False)
_ARGUMENTS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class RegionCalls:
    calls: list[ParsedCall]
    end: int  # characters of the region those calls take up


def call_of(value: Any, text: str | None = None) -> ParsedCall | None:
    """A call from a decoded `{"name": ..., "arguments" | "parameters": {...}}`, whose JSON
    text is `text` when the caller has it (its arguments are then kept as written)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
        text = None
    if not isinstance(arguments, dict):
        return None
    written = _arguments_text(text, arguments) if text is not None else None
    return ParsedCall(value["name"], written or json.dumps(arguments, ensure_ascii=False))


def arguments_start(call_text: str) -> int | None:
    """Where the arguments object of the call written in `call_text` starts, once its key came."""
    match = _ARGUMENTS_KEY.search(call_text)
    if match is None or not call_text.startswith("{", match.end()):
        return None
    return match.end()


def _arguments_text(call_text: str, arguments: dict) -> str | None:
    """The text of the call's arguments object as the model wrote it, if it is found there."""
    start = arguments_start(call_text)
    if start is None:
        return None
    try:
        value, end = _JSON.raw_decode(call_text, start)
    except ValueError:
        return None
    return call_text[start:end] if value == arguments else None


def skip_space(text: str, pos: int, also: str = "") -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] in also):
        pos += 1
    return pos


class ToolParser(ABC):
    """Finds tool calls in one family's syntax. It keeps nothing of the texts it reads: one
    instance serves every choice of the requests offering the same tools."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # open a region anywhere in the text
    leading: ClassVar[str] = ""  # opens a region at the start of the text (spaces aside)
    template_hints: ClassVar[tuple[str, ...]] = ()  # chat-template text that picks this parser
    tag_start: ClassVar[str] = ""  # begins a tag that may end a call's text (none: JSON ends it)

    def markup(self) -> tuple[str, ...]:
        """The texts its syntax writes that a tokenizer may hold as special tokens, which
        decoding must then write out for this parser to read them."""
        return self.markers

    def for_tools(self, schemas: dict[str, dict[str, Any]]) -> ToolParser:
        """This parser for a request's functions (their parameter schemas by name); the
        families that write argument values as untyped text read their types there."""
        return self

    def region_start(self, text: str) -> int | None:
        if self.leading and text.lstrip().startswith(self.leading):
            return 0  # the spaces before belong to the region, not to the content
        return min((i for m in self.markers if (i := text.find(m)) >= 0), default=None)

    def safe_end(self, text: str) -> int:
        """How much of a text with no region yet is content for sure: a region may still
        open at the start (while only spaces came) or at a marker's partial prefix."""
        if self.leading and self.leading.startswith(text.lstrip()):
            return 0
        return min((len(held_back(text, m)) for m in self.markers), default=len(text))

    @abstractmethod
    def calls(self, region: str, final: bool) -> RegionCalls:
        """The complete calls at the start of `region`; `final` once no more text comes."""

    def open_call(self, region: str, end: int) -> str | None:
        """The text of the call being written after the complete calls (`region[end:]`), from
        its `{` (a syntax that is no JSON renders it as the JSON call it becomes, a text that
        only grows); None while none has begun, or for a syntax whose calls cannot stream."""
        return None

    def held_tail(self, region: str, end: int, call_text: str) -> str | None:
        """Once `call_text` (`open_call`'s) has streamed whole: the end of the model's text it
        holds back, if the next delta may stream without parsing the region again (else
        None). A JSON family's call text is the model's own: nothing is held back."""
        return "" if region.endswith(call_text) else None

    def plain_arguments(self, text: str) -> tuple[str, str] | None:
        """What `text` (the held-back tail, then a delta) adds to the open call's arguments,
        and the tail it holds back in turn; None when it may end the call, or more."""
        tag = self.tag_start
        if "}" in text or "]" in text or (tag and tag in text):
            return None
        return text, ""

    def cut_off(self, region: str, end: int) -> bool:
        """Whether the text ended inside a call, after the complete ones: JSON cut short, as
        opposed to text that is no call at all."""
        call_text = self.open_call(region, end)
        return call_text is not None and _is_cut_json(call_text)


class HermesParser(ToolParser):
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` per call."""

    name = "hermes"
    markers = ("<tool_call>",)
    template_hints = ("<tool_call>",)
    tag_start = "<"
    _close = "</tool_call>"

    def markup(self) -> tuple[str, ...]:
        return (*self.markers, self._close)

    def calls(self, region: str, final: bool) -> RegionCalls:
        calls, end = [], 0
        while True:
            start = skip_space(region, end)
            if not region.startswith(self.markers[0], start):
                break
            body_start = start + len(self.markers[0])
            close = region.find(self._close, body_start)
            if close < 0 and not final:
                break
            # At the end of the text a missing close tag is forgiven.
            body_end = len(region) if close < 0 else close
            body = region[body_start:body_end].strip()
            call = call_of(_loads(body), body)
            if call is None:
                break
            calls.append(call)
            end = len(region) if close < 0 else close + len(self._close)
        return RegionCalls(calls, end)

    def cut_off(self, region: str, end: int) -> bool:
        start = skip_space(region, end)
        if not region.startswith(self.markers[0], start) or self._close in region[start:]:
            return False
        body = region[start + len(self.markers[0]) :].strip()
        return not body or _is_cut_json(body)

    def open_call(self, region: str, end: int) -> str | None:
        start = skip_space(region, end)
        if not region.startswith(self.markers[0], start):
            return None
        body_start = start + len(self.markers[0])
        close = region.find(self._close, body_start)  # a close tag ends even a malformed call
        return _object_from(region[:close] if close >= 0 else held_back(region, self._close),
                            body_start)  # fmt: skip


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
            start = skip_space(region, pos, also=";")
            try:
                value, stop = _JSON.raw_decode(region, start)
            except ValueError:
                break
            call = call_of(value, region[start:stop])
            if call is None:
                break
            calls.append(call)
            pos = end = stop
        return RegionCalls(calls, end)

    def open_call(self, region: str, end: int) -> str | None:
        if end == 0 and region.startswith(self.markers[0]):
            end = len(self.markers[0])
        return _object_from(region, end, also=";")


class ForcedCallParser(ToolParser):
    """The output of a call generated under the tool-call JSON schema: one bare
    `{"name": ..., "arguments": {...}}` object, whatever the model's family."""

    name = "forced"
    leading = "{"

    def calls(self, region: str, final: bool) -> RegionCalls:
        start = skip_space(region, 0)
        try:
            value, stop = _JSON.raw_decode(region, start)
        except ValueError:
            return RegionCalls([], 0)
        call = call_of(value, region[start:stop])
        return RegionCalls([call], stop) if call else RegionCalls([], 0)

    def open_call(self, region: str, end: int) -> str | None:
        return _object_from(region, 0) if end == 0 else None


def _object_from(text: str, pos: int, also: str = "") -> str | None:
    """`text` from the `{` that opens at `pos` (spaces and `also` skipped), if one does."""
    start = skip_space(text, pos, also)
    return text[start:] if text.startswith("{", start) else None


def held_back(text: str, tag: str) -> str:
    """`text` without an end that may be the start of `tag`, until the next delta tells."""
    for i in range(max(0, len(text) - len(tag) + 1), len(text)):
        if tag.startswith(text[i:]):
            return text[:i]
    return text


def _loads(text: str) -> Any:
    try:
        return _JSON.decode(text)
    except ValueError:
        return None


def partial_json(text: str, allow: Allow = Allow.ALL) -> Any | None:
    """What JSON text cut short holds so far (None if it is no JSON prefix at all). The
    parser raises more than ValueError on some malformed text."""
    try:
        return partial_loads(text, allow)
    except Exception:
        return None


def _is_cut_json(text: str) -> bool:
    """`text` is the start of a JSON value, not the whole of one nor invalid."""
    try:
        _JSON.raw_decode(text)
        return False
    except ValueError:
        return partial_json(text) is not None
