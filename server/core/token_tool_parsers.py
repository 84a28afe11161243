"""Tool calls between the special tokens of DeepSeek V3.1 and Kimi K2, their arguments JSON:

    DeepSeek V3.1  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>
                   {"city": "Paris"}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    Kimi K2        <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
                   <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>...
                   <|tool_calls_section_end|>

A call names its function, then its arguments object follows the separator token; the call
being written is rendered as the JSON call it becomes (`{"name": ..., "arguments": ` and the
arguments as written so far), so `ToolCallStream` streams its arguments as the model writes
them.
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from typing import ClassVar

from server.core.tool_parsers import ParsedCall, RegionCalls, ToolParser, held_back, skip_space

_JSON = json.JSONDecoder(strict=False)  # models write raw newlines inside strings


class TokenDelimitedParser(ToolParser):
    """Calls opened by `call_begin`, named, then `separator`, the arguments object and
    `call_end`; a section of them between `markers[0]` and `section_end` (the section tokens
    may be missing: a call's own begin token opens the region too)."""

    call_begin: ClassVar[str]
    separator: ClassVar[str]
    call_end: ClassVar[str]
    section_end: ClassVar[str]

    @abstractmethod
    def name_of(self, text: str) -> str | None:
        """The function's name, from the text between a call's begin token and the
        separator; None if it is none."""

    def calls(self, region: str, final: bool) -> RegionCalls:
        calls, end = [], 0
        pos = self._past_section_begin(region)
        while True:
            head = self._head(region, pos)
            if head is None:
                break
            name, args_start = head
            close = region.find(self.call_end, args_start)
            if close < 0 and not final:
                break
            # At the end of the text a missing end token is forgiven.
            body = region[args_start : len(region) if close < 0 else close].strip()
            try:
                arguments = _JSON.decode(body) if body else {}
            except ValueError:
                break
            if not isinstance(arguments, dict):
                break
            calls.append(ParsedCall(name, body or "{}"))
            pos = end = len(region) if close < 0 else close + len(self.call_end)
        if calls:
            after = skip_space(region, end)
            if region.startswith(self.section_end, after):
                end = after + len(self.section_end)
        return RegionCalls(calls, end)

    def open_call(self, region: str, end: int) -> str | None:
        head = self._head(region, self._past_section_begin(region) if end == 0 else end)
        if head is None:
            return None
        name, args_start = head
        close = region.find(self.call_end, args_start)
        written = region[args_start:close] if close >= 0 else held_back(region[args_start:],
                                                                        self.call_end)
        written = written.lstrip()
        if not written.startswith("{"):
            return None
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {written}'

    def cut_off(self, region: str, end: int) -> bool:
        start = skip_space(region, self._past_section_begin(region) if end == 0 else end)
        if not region.startswith(self.call_begin, start):
            # A section begun with no call in it yet, or a call's begin token cut short.
            opened = end == 0 and self._past_section_begin(region) > 0
            return opened and self.call_begin.startswith(region[start:])
        name_start = start + len(self.call_begin)
        if self.separator not in region[name_start:]:  # cut in its name, or no call at all
            written = held_back(region[name_start:], self.separator).strip()
            return not written or self.name_of(written) is not None
        call_text = self.open_call(region, end)
        return call_text is None or super().cut_off(region, end)

    def _past_section_begin(self, region: str) -> int:
        start = skip_space(region, 0)
        if region.startswith(self.markers[0], start):
            return start + len(self.markers[0])
        return 0

    def _head(self, region: str, pos: int) -> tuple[str, int] | None:
        """The name of the call that begins at `pos` (spaces skipped) and where its
        arguments start, once its separator came."""
        start = skip_space(region, pos)
        if not region.startswith(self.call_begin, start):
            return None
        name_start = start + len(self.call_begin)
        separator = region.find(self.separator, name_start)
        if separator < 0:
            return None
        name = self.name_of(region[name_start:separator])
        return None if name is None else (name, separator + len(self.separator))


_PLAIN_NAME = re.compile(r"[^\s<>{}]+")


class DeepSeekV31Parser(TokenDelimitedParser):
    name = "deepseek_v31"
    markers = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")
    template_hints = ("tool▁calls▁begin",)
    call_begin = "<｜tool▁call▁begin｜>"
    separator = "<｜tool▁sep｜>"
    call_end = "<｜tool▁call▁end｜>"
    section_end = "<｜tool▁calls▁end｜>"

    def name_of(self, text: str) -> str | None:
        name = text.strip()
        return name if _PLAIN_NAME.fullmatch(name) else None


_KIMI_ID = re.compile(r"(?:functions\.)?([^\s<>{}:]+)(?::\d+)?")


class KimiK2Parser(TokenDelimitedParser):
    """The call's id names the function: `functions.NAME:INDEX`."""

    name = "kimi_k2"
    markers = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")
    template_hints = ("<|tool_calls_section_begin|>",)
    call_begin = "<|tool_call_begin|>"
    separator = "<|tool_call_argument_begin|>"
    call_end = "<|tool_call_end|>"
    section_end = "<|tool_calls_section_end|>"

    def name_of(self, text: str) -> str | None:
        match = _KIMI_ID.fullmatch(text.strip())
        return match.group(1) if match else None
