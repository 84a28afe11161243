"""Which parser reads a model's tool calls: the one `--tool-call-parser` names, else the one
whose family's syntax the chat template mentions."""

from __future__ import annotations

from server.core.tag_tool_parsers import (
    DeepSeekV32Parser,
    Glm45Parser,
    MiniMaxM2Parser,
    Qwen3CoderParser,
)
from server.core.token_tool_parsers import DeepSeekV31Parser, KimiK2Parser, MistralParser
from server.core.tool_parsers import HermesParser, Llama3JsonParser, ToolParser

# Looked for in this order: the tag families' templates mention `<tool_call>` too.
PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (DeepSeekV32Parser, DeepSeekV31Parser, KimiK2Parser, MiniMaxM2Parser,
                   Qwen3CoderParser, Glm45Parser, HermesParser, Llama3JsonParser, MistralParser)
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
