"""Tool calls written as tags, not JSON: Qwen3-Coder's `<function=...>` blocks, GLM-4.5's
`<arg_key>`/`<arg_value>` pairs, MiniMax M2's and DeepSeek V3.2's `<invoke>` blocks. Their
values are raw text, typed by the parameter's schema in the request's tools (DeepSeek V3.2's
tags say which values are JSON). The call being written is rendered as the JSON call it becomes, a
text that only grows, so `ToolCallStream` streams it as it does a JSON family's:

    <tool_call>\\n<function=f>\\n<parameter=days>\\n3\\n</parameter>\\n<parameter=city>\\nPar
    {"name": "f", "arguments": {"days": 3, "city": "Par

A string value streams as it is written; any other waits for its closing tag, since only the
whole text tells whether it parses.
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from server.core.tool_parsers import ParsedCall, RegionCalls, ToolParser, held_back, skip_space

_NAME = re.compile(r"[^\s<>]+")  # a function's name, as the tags delimit it
_KEY = re.compile(r"[^<>\n]+")  # a parameter's name
_GLM_NAME_END = re.compile(r"[\n<]")


@dataclass
class TagCall:
    """What the text holds of one call, read from its opening tag."""

    name: str | None = None  # once it came whole
    params: list[tuple[str, str]] = field(default_factory=list)  # closed: (key, raw value)
    open_param: tuple[str, str] | None = None  # the one being written: its key, text so far
    params_end: int = 0  # where the last closed parameter (or the name) ends
    end: int | None = None  # where the call ends, once its closing tags came
    closing_begun: bool = False  # the open value's text ends with what may begin its closing tag
    cut: bool = False  # the text ended where more of the call was due
    broken: bool = False  # the text holds something else where a tag was due
    json_keys: set[str] = field(default_factory=set)  # values whose tag says they are JSON


class _Cursor:
    """Reads a call's tags off `text` from `pos`, marking `call` cut or broken when it fails."""

    def __init__(self, text: str, pos: int, call: TagCall) -> None:
        self.text, self.pos, self.call = text, pos, call

    def tag(self, *options: str) -> str | None:
        """The option that comes next (spaces skipped), consumed."""
        start = skip_space(self.text, self.pos)
        rest = self.text[start:]
        for option in options:
            if rest.startswith(option):
                self.pos = start + len(option)
                return option
        if any(option.startswith(rest) for option in options):
            self.call.cut = True
        else:
            self.call.broken = True
        return None

    def until(self, stop: str) -> str | None:
        """The text up to `stop`, both consumed; None if `stop` has not come yet."""
        index = self.text.find(stop, self.pos)
        if index < 0:
            self.call.cut = True
            return None
        found, self.pos = self.text[self.pos : index], index + len(stop)
        return found

    def name(self, text: str | None) -> bool:
        """Take `text` as the call's name, if it is one."""
        name = (text or "").strip()
        if text is not None and not _NAME.fullmatch(name):
            self.call.broken = True
        if self.call.cut or self.call.broken:
            return False
        self.call.name, self.call.params_end = name, self.pos
        return True

    def value(self, key: str | None, stop: str) -> bool:
        """Read the value of parameter `key` up to `stop`; False once the text gave out."""
        if key is None:
            return False
        if not _KEY.fullmatch(key.strip()):
            self.call.broken = True
            return False
        start = self.pos
        raw = self.until(stop)
        if raw is None:
            written = self.text[start:]
            kept = held_back(written, stop)
            self.call.open_param = (key.strip(), kept)
            self.call.closing_begun = len(kept) < len(written)
            return False
        self.call.params.append((key.strip(), raw))
        self.call.params_end = self.pos
        return True


class TagCallParser(ToolParser):
    """A family whose calls are tags after `<tool_call>`; values typed by `schemas`."""

    markers = ("<tool_call>",)
    closing: ClassVar[tuple[str, ...]]  # the tags that end a call, after its last parameter
    # The template writes each value between newlines, which are no part of it.
    trims_newlines: ClassVar[bool] = False

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self.schemas = schemas or {}  # each function's parameters schema, by name

    def for_tools(self, schemas: dict[str, dict[str, Any]]) -> ToolParser:
        return type(self)(schemas)

    def markup(self) -> tuple[str, ...]:
        return (*self.markers, *self.closing)

    @abstractmethod
    def scan(self, text: str, pos: int) -> TagCall:
        """The call whose opening tag is next in `text` from `pos` (spaces skipped)."""

    def raw_value(self, raw: str) -> str:
        """A value's text as the model meant it."""
        if not self.trims_newlines:
            return raw
        raw = raw[1:] if raw.startswith("\n") else raw
        return raw[:-1] if raw.endswith("\n") else raw

    def calls(self, region: str, final: bool) -> RegionCalls:
        calls: list[ParsedCall] = []
        end = 0
        while True:
            call = self.scan(region, end)
            forgiven = final and self._unclosed(call, region)
            if call.name is None or (call.end is None and not forgiven):
                break
            calls.append(ParsedCall(call.name, self._arguments(call) + "}"))
            end = len(region) if call.end is None else call.end
        return RegionCalls(calls, end)

    def open_call(self, region: str, end: int) -> str | None:
        call = self.scan(region, end)
        if call.name is None:
            return None
        head = _json({"name": call.name})[:-1]
        return f'{head}, "arguments": {self._arguments(call)}'

    def cut_off(self, region: str, end: int) -> bool:
        call = self.scan(region, end)
        return call.name is None and call.cut

    def held_tail(self, region: str, end: int, call_text: str) -> str | None:
        """Inside a string value that streams as written: the newline held back, which may
        be the template's before the closing tag."""
        call = self.scan(region, end)
        if call.name is None or call.open_param is None or call.closing_begun:
            return None
        key, raw = call.open_param
        if self.json_value(call, key):
            return None
        if not self.trims_newlines:
            return ""
        if not raw:
            return None  # whether the value's first newline is the template's is not known yet
        body = raw[1:] if raw.startswith("\n") else raw
        return "\n" if body.endswith("\n") else ""

    def plain_arguments(self, text: str) -> tuple[str, str] | None:
        if "<" in text:  # may begin the value's closing tag
            return None
        held = "\n" if self.trims_newlines and text.endswith("\n") else ""
        return _json(text[: len(text) - len(held)])[1:-1], held

    def _unclosed(self, call: TagCall, region: str) -> bool:
        """At the end of the text, missing closing tags are forgiven once every parameter
        closed."""
        if call.broken or call.open_param is not None:
            return False
        rest = region[call.params_end :]
        for tag in self.closing:
            rest = rest.lstrip()
            if not rest or tag.startswith(rest):
                return True
            if not rest.startswith(tag):
                return False
            rest = rest[len(tag) :]
        return not rest.strip()

    def json_value(self, call: TagCall, key: str) -> bool:
        """Whether the value of parameter `key` is JSON, not text: its schema declares only
        types other than string."""
        assert call.name is not None
        return _wants_json(_properties(self.schemas.get(call.name)).get(key))

    def _arguments(self, call: TagCall) -> str:
        """The JSON text of the call's arguments so far, without the closing brace."""
        parts = [_member(key, self._typed(raw, self.json_value(call, key)))
                 for key, raw in call.params]  # fmt: skip
        if call.open_param is not None:
            key, raw = call.open_param
            value = "" if self.json_value(call, key) else _json(self.raw_value(raw))[:-1]
            parts.append(f"{_json(key)}: {value}")
        return "{" + ", ".join(parts)

    def _typed(self, raw: str, wants_json: bool) -> Any:
        """A value as JSON where it should be one and its text parses; else the text."""
        text = self.raw_value(raw)
        if not wants_json:
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text


class Qwen3CoderParser(TagCallParser):
    """Qwen3-Coder: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
    </tool_call>`, each value between the newlines its template writes around it."""

    name = "qwen3_coder"
    template_hints = ("<parameter=",)
    closing = ("</function>", "</tool_call>")
    trims_newlines = True

    def scan(self, text: str, pos: int) -> TagCall:
        call = TagCall()
        cursor = _Cursor(text, pos, call)
        if not (cursor.tag("<tool_call>") and cursor.tag("<function=")):
            return call
        if not cursor.name(cursor.until(">")):
            return call
        while (tag := cursor.tag("<parameter=", "</function>")) == "<parameter=":
            if not cursor.value(cursor.until(">"), "</parameter>"):
                return call
        if tag is not None and cursor.tag("</tool_call>"):
            call.end = cursor.pos
        return call


class Glm45Parser(TagCallParser):
    """GLM-4.5, 4.6 and 4.7: `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>
    ...</tool_call>`, newlines between the tags or none."""

    name = "glm45"
    template_hints = ("<arg_key>",)
    closing = ("</tool_call>",)

    def scan(self, text: str, pos: int) -> TagCall:
        call = TagCall()
        cursor = _Cursor(text, pos, call)
        if not cursor.tag("<tool_call>"):
            return call
        cursor.pos = skip_space(text, cursor.pos)
        name_end = _GLM_NAME_END.search(text, cursor.pos)
        if name_end is None:
            call.cut = True
            return call
        name, cursor.pos = text[cursor.pos : name_end.start()], name_end.start()
        if not cursor.name(name):
            return call
        while (tag := cursor.tag("<arg_key>", "</tool_call>")) == "<arg_key>":
            key = cursor.until("</arg_key>")
            if key is None or not cursor.tag("<arg_value>"):
                return call
            if not cursor.value(key, "</arg_value>"):
                return call
        if tag is not None:
            call.end = cursor.pos
        return call


class InvokeBlockParser(TagCallParser):
    """A block of calls, each `<invoke name="NAME">` with `<parameter name="KEY">VALUE
    </parameter>`s, newlines between the tags (the tag names as a family writes them); the
    block's end is taken with its last call."""

    block: ClassVar[str]  # opens the block
    invoke: ClassVar[str]  # opens a call: its name follows, up to `">`
    parameter: ClassVar[str]  # opens a parameter: its key (and attributes) follow, up to `">`
    parameter_end: ClassVar[str]

    def param_key(self, head: str, call: TagCall) -> str | None:
        """The parameter's key, from its opening tag's text after `parameter`."""
        return head

    def scan(self, text: str, pos: int) -> TagCall:
        call = TagCall()
        cursor = _Cursor(text, pos, call)
        opening = cursor.tag(self.block, self.invoke)
        if opening is None or (opening == self.block and not cursor.tag(self.invoke)):
            return call
        if not cursor.name(cursor.until('">')):
            return call
        while (tag := cursor.tag(self.parameter, self.closing[0])) == self.parameter:
            head = cursor.until('">')
            key = None if head is None else self.param_key(head, call)
            if head is not None and key is None:
                call.broken = True
            if not cursor.value(key, self.parameter_end):
                return call
        if tag is None:
            return call
        block_end = skip_space(text, cursor.pos)
        after = text[block_end:]
        if after.startswith(self.closing[1]):
            call.end = block_end + len(self.closing[1])
        elif not (self.closing[1].startswith(after) or self.invoke.startswith(after)):
            call.end = cursor.pos  # the next call has begun (or text after an open block)
        return call


class MiniMaxM2Parser(InvokeBlockParser):
    """MiniMax M2: `<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE
    </parameter>...</invoke><invoke ...>...</invoke></minimax:tool_call>`."""

    name = "minimax_m2"
    markers = ("<minimax:tool_call>",)
    template_hints = ("<minimax:tool_call>",)
    closing = ("</invoke>", "</minimax:tool_call>")
    block = "<minimax:tool_call>"
    invoke = '<invoke name="'
    parameter = '<parameter name="'
    parameter_end = "</parameter>"


_DSML_PARAMETER = re.compile(r'([^"<>\n]+)" string="(true|false)')


class DeepSeekV32Parser(InvokeBlockParser):
    """DeepSeek V3.2's DSML: `<｜DSML｜function_calls><｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>...
    </｜DSML｜invoke>...</｜DSML｜function_calls>`; `string="false"` marks a value written as
    JSON (numbers, booleans, arrays, objects), `string="true"` one written as it is. The
    encoding puts two newlines before the block: they are the calls', not the content's."""

    name = "deepseek_v32"
    markers = ("\n\n<｜DSML｜function_calls>", "<｜DSML｜function_calls>")
    template_hints = ("｜DSML｜",)
    closing = ("</｜DSML｜invoke>", "</｜DSML｜function_calls>")
    block = "<｜DSML｜function_calls>"
    invoke = '<｜DSML｜invoke name="'
    parameter = '<｜DSML｜parameter name="'
    parameter_end = "</｜DSML｜parameter>"

    def param_key(self, head: str, call: TagCall) -> str | None:
        match = _DSML_PARAMETER.fullmatch(head)
        if match is None:
            return None
        if match.group(2) == "false":
            call.json_keys.add(match.group(1))
        return match.group(1)

    def json_value(self, call: TagCall, key: str) -> bool:
        return key in call.json_keys


def _wants_json(schema: Any) -> bool:
    """Whether a parameter's schema declares only types other than string."""
    types = _declared_types(schema)
    return bool(types) and "string" not in types


def _declared_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    listed = declared if isinstance(declared, list) else [declared]
    types = {kind for kind in listed if isinstance(kind, str)}
    for options in (schema.get("anyOf"), schema.get("oneOf")):
        for option in options if isinstance(options, list) else ():
            types |= _declared_types(option)
    return types


def _properties(parameters: Any) -> dict[str, Any]:
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return properties if isinstance(properties, dict) else {}


def _member(key: str, value: Any) -> str:
    return f"{_json(key)}: {_json(value)}"


def _json(value: Any) -> str:
    # As written: a string value's prefix streams as its own text, so all must agree on this.
    return json.dumps(value, ensure_ascii=False)
