"""Tool calls between the special tokens of DeepSeek V3.1, Kimi K2 and Mistral (tokenizer v11
on), their arguments JSON:

    DeepSeek V3.1  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>
                   {"city": "Paris"}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    Kimi K2        <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
                   <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>...
                   <|tool_calls_section_end|>
    Mistral        [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...

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

from server.core.tool_parsers import (
    ParsedCall,
    RegionCalls,
    ToolParser,
    call_of,
    held_back,
    skip_space,
)

_JSON = json.JSONDecoder(strict=False)  # models write raw newlines inside strings


class TokenDelimitedParser(ToolParser):
    """Calls opened by `call_begin`, named, then `separator`, the arguments object and
    `call_end` (none: the object ends the call); a section of them between `section_begin`
    and `section_end`, if the family has one (the section tokens may be missing: a call's
    own begin token opens the region too)."""

    call_begin: ClassVar[str]
    separator: ClassVar[str]
    call_end: ClassVar[str] = ""
    section_begin: ClassVar[str] = ""
    section_end: ClassVar[str] = ""

    def markup(self) -> tuple[str, ...]:
        tokens = (self.section_begin, self.call_begin, self.separator, self.call_end,
                  self.section_end)  # fmt: skip
        return tuple(token for token in tokens if token)

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
            arguments = self._arguments(region, args_start, final)
            if arguments is None:
                break
            body, pos = arguments
            calls.append(ParsedCall(name, body))
            end = pos
        if calls and self.section_end:
            after = skip_space(region, end)
            if region.startswith(self.section_end, after):
                end = after + len(self.section_end)
        return RegionCalls(calls, end)

    def _arguments(self, region: str, start: int, final: bool) -> tuple[str, int] | None:
        """The text of the arguments object that starts at `start` and where its call ends;
        None while it may still grow, or if it is no object."""
        if not self.call_end:
            begin = skip_space(region, start)
            try:
                value, stop = _JSON.raw_decode(region, begin)
            except ValueError:
                return None
            return (region[begin:stop], stop) if isinstance(value, dict) else None
        close = region.find(self.call_end, start)
        if close < 0 and not final:
            return None
        # At the end of the text a missing end token is forgiven.
        body = region[start : len(region) if close < 0 else close].strip()
        try:
            value = _JSON.decode(body) if body else {}
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        return body or "{}", len(region) if close < 0 else close + len(self.call_end)

    def open_call(self, region: str, end: int) -> str | None:
        head = self._head(region, self._past_section_begin(region) if end == 0 else end)
        if head is None:
            return None
        name, args_start = head
        close = region.find(self.call_end, args_start) if self.call_end else -1
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
        if self.section_begin and region.startswith(self.section_begin, start):
            return start + len(self.section_begin)
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
    section_begin = "<｜tool▁calls▁begin｜>"
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
    section_begin = "<|tool_calls_section_begin|>"
    call_begin = "<|tool_call_begin|>"
    separator = "<|tool_call_argument_begin|>"
    call_end = "<|tool_call_end|>"
    section_end = "<|tool_calls_section_end|>"

    def name_of(self, text: str) -> str | None:
        match = _KIMI_ID.fullmatch(text.strip())
        return match.group(1) if match else None


class MistralParser(TokenDelimitedParser):
    """Mistral: `[TOOL_CALLS]NAME[ARGS]{...}` a call (tokenizer v13 on; v11 writes
    `[CALL_ID]ID` before `[ARGS]`), or before v11 one `[TOOL_CALLS][{"name": ...,
    "arguments": {...}}, ...]` array; a leading JSON array of calls counts too, the token
    missing."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    leading = "[{"
    template_hints = ("[TOOL_CALLS]",)
    call_begin = "[TOOL_CALLS]"
    separator = "[ARGS]"
    _call_id = "[CALL_ID]"

    def markup(self) -> tuple[str, ...]:
        return (*super().markup(), self._call_id)

    def name_of(self, text: str) -> str | None:
        name = text.split(self._call_id, 1)[0].strip()
        return name if _PLAIN_NAME.fullmatch(name) else None

    def calls(self, region: str, final: bool) -> RegionCalls:
        array = self._array_start(region)
        return super().calls(region, final) if array is None else _array_calls(region, array)

    def open_call(self, region: str, end: int) -> str | None:
        return super().open_call(region, end) if self._array_start(region) is None else None

    def cut_off(self, region: str, end: int) -> bool:
        return self._array_start(region) is None and super().cut_off(region, end)

    def _array_start(self, region: str) -> int | None:
        """Where the array of calls of the older syntax starts, if the region holds one."""
        start = skip_space(region, 0)
        if region.startswith(self.call_begin, start):
            start = skip_space(region, start + len(self.call_begin))
        return start if region.startswith("[", start) else None


def _array_calls(region: str, start: int) -> RegionCalls:
    try:
        value, stop = _JSON.raw_decode(region, start)
    except ValueError:
        return RegionCalls([], 0)
    calls = [call_of(item) for item in (value if isinstance(value, list) else [value])]
    if not calls or None in calls:
        return RegionCalls([], 0)
    return RegionCalls(calls, stop)
