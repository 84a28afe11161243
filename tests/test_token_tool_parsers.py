"""DeepSeek V3.1's and Kimi K2's tool calls (special tokens around JSON arguments) on their
real markup, whole and streamed at every split; and through the server with the openai
client."""

from __future__ import annotations

import json
import random

import openai
import pytest
from fake_engine import ScriptedEngine, ToolTemplateTokenizer
from server_helpers import running_server
from test_tool_parsers import incomplete, split_at_random, stream, stream_pieces

from server.core.token_tool_parsers import DeepSeekV31Parser, KimiK2Parser
from server.core.tool_parser_choice import parser_for_template, parser_named
from server.core.tool_parsers import ParsedCall

DEEPSEEK, KIMI = DeepSeekV31Parser(), KimiK2Parser()
CODE = 'if a < b:\n    print("<b>", a)\n'


def deepseek_calls(*calls: tuple[str, str]) -> str:
    """Calls as DeepSeek V3.1's template writes them: `(name, arguments JSON)` each."""
    body = "".join(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>"
                   for name, arguments in calls)  # fmt: skip
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def kimi_calls(*calls: tuple[str, str]) -> str:
    """Calls as Kimi K2 writes them: each named by its id `functions.NAME:INDEX`."""
    body = "".join(f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
                   f"{arguments}<|tool_call_end|>" for i, (name, arguments) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


WEATHER = ParsedCall("get_weather", '{"city": "Paris", "days": 3}')
WRITE = ParsedCall("write_file", json.dumps({"path": "a.py", "content": CODE}))
BOTH = ((WEATHER.name, WEATHER.arguments), (WRITE.name, WRITE.arguments))
FAMILIES = [(DEEPSEEK, deepseek_calls), (KIMI, kimi_calls)]
IDS = ["deepseek_v31", "kimi_k2"]

CASES = [
    *[(parser, calls((WEATHER.name, WEATHER.arguments)), "", [WEATHER])
      for parser, calls in FAMILIES],
    *[(parser, "Let me check.\n\n" + calls(*BOTH), "Let me check.\n\n", [WEATHER, WRITE])
      for parser, calls in FAMILIES],
    *[(parser, calls(("get_time", "{}")), "", [ParsedCall("get_time", "{}")])
      for parser, calls in FAMILIES],
    (DEEPSEEK, "Not needed: 2 < 3, <b>bold</b>.", "Not needed: 2 < 3, <b>bold</b>.", []),
    (KIMI, "Not needed: a <|b|> c.", "Not needed: a <|b|> c.", []),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_text(parser, text, content, calls):
    assert stream(parser, [text]) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_one_character_at_a_time(parser, text, content, calls):
    # Content once sent is never taken back: no token, nor its first characters, reached it.
    assert stream(parser, [*text, ""]) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_at_random_boundaries(parser, text, content, calls):
    rng = random.Random(11)
    for _ in range(30):
        assert stream(parser, split_at_random(text, rng)) == (content, calls)


@pytest.mark.parametrize(("parser", "calls"), FAMILIES, ids=IDS)
def test_every_split_in_two_gives_the_same_calls(parser, calls):
    text = "Hi. " + calls(*BOTH)
    for cut in range(1, len(text)):
        assert stream(parser, [text[:cut], text[cut:]]) == ("Hi. ", [WEATHER, WRITE])


@pytest.mark.parametrize(("parser", "calls"), FAMILIES, ids=IDS)
def test_the_arguments_stream_as_written_after_the_name(parser, calls):
    content = "".join(f"line {i}\n" for i in range(30))
    arguments = json.dumps({"path": "a.py", "content": content})
    _, parsed, pieces = stream_pieces(parser, [*calls(("write_file", arguments))])
    assert parsed == [ParsedCall("write_file", arguments)]
    assert [p.name for p in pieces if p.name] == ["write_file"]  # once, and whole
    assert len([p for p in pieces if p.arguments]) > len(content) // 2


@pytest.mark.parametrize(
    ("parser", "text", "arguments"),
    [
        (DEEPSEEK, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                   '{"city": "Par', '{"city": "Par'),
        (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
               '<|tool_call_argument_begin|>{"city": "Par', '{"city": "Par'),
        (DEEPSEEK, "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{", "{"),
    ],
)  # fmt: skip
def test_a_call_cut_in_its_arguments_ends_incomplete(parser, text, arguments):
    for pieces in ([text], [*text, ""]):
        content, calls, seen = stream_pieces(parser, pieces)
        assert (content, calls, incomplete(seen)) == ("", [ParsedCall("get_weather", arguments)],
                                                      [0])  # fmt: skip


@pytest.mark.parametrize(("parser", "calls"), FAMILIES, ids=IDS)
def test_end_tokens_missing_at_the_end_are_forgiven(parser, calls):
    text = calls((WEATHER.name, WEATHER.arguments))
    for cut in (parser.section_end, parser.call_end + parser.section_end):
        for pieces in ([text.removesuffix(cut)], [*text.removesuffix(cut), ""]):
            content, parsed, seen = stream_pieces(parser, pieces)
            assert (content, parsed, incomplete(seen)) == ("", [WEATHER], [])


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (DEEPSEEK, "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_wea"),
        (DEEPSEEK, "Sure.<｜tool▁calls▁begin｜>"),
        (KIMI, "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_"),
    ],
)
def test_a_call_cut_before_its_arguments_leaves_no_markup(parser, text):
    assert stream(parser, [text]) == ("Sure.", [])
    assert stream(parser, [*text, ""]) == ("Sure.", [])


@pytest.mark.parametrize(
    ("template", "parser"),
    [  # the templates' own text for a call
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + "
         "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}",
         DeepSeekV31Parser),
        ("{{- '<|tool_calls_section_begin|>' -}}{%- for tool_call in message['tool_calls'] -%}"
         "<|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>", KimiK2Parser),
    ],
)  # fmt: skip
def test_the_chat_template_picks_the_family(template, parser):
    assert type(parser_for_template(template)) is parser


def test_the_families_are_named():
    assert isinstance(parser_named("deepseek_v31"), DeepSeekV31Parser)
    assert isinstance(parser_named("kimi_k2"), KimiK2Parser)


# ---- through the server ---------------------------------------------------------------------


class DeepSeekTokenizer(ToolTemplateTokenizer):
    chat_template = "{{'<｜tool▁calls▁begin｜>'}}{% for t in tools %}{% endfor %}"


class KimiTokenizer(ToolTemplateTokenizer):
    chat_template = "{{ '<|tool_calls_section_begin|>' }}{% for t in tools %}{% endfor %}"


TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "write_file")]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather in Paris, then write a.py?"}]


@pytest.fixture(params=IDS)
def scripted_server(request):
    """A server whose model answers with some text, then two calls in its family's tokens,
    in pieces of 3 characters."""
    tokenizer, calls = ((DeepSeekTokenizer(), deepseek_calls) if request.param == IDS[0]
                        else (KimiTokenizer(), kimi_calls))
    text = "Checking. " + calls(*BOTH)
    script = [text[i : i + 3] for i in range(0, len(text), 3)]
    with running_server(ScriptedEngine(script, tokenizer)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none")


def test_calls_in_a_whole_response(scripted_server):
    reply = scripted_server.chat.completions.create(model="default", messages=MESSAGES,
                                                    tools=TOOLS)  # fmt: skip
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Checking. ")
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris", "days": 3}),
                     ("write_file", {"path": "a.py", "content": CODE})]


def test_calls_streamed_as_tool_call_deltas(scripted_server):
    stream_ = scripted_server.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, stream=True
    )
    chunks = [chunk for chunk in stream_ if chunk.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    names = [(d.index, d.function.name) for d in deltas if d.function.name]
    arguments = ["".join(d.function.arguments or "" for d in deltas if d.index == i)
                 for i in (0, 1)]  # fmt: skip
    assert content == "Checking. "
    assert names == [(0, "get_weather"), (1, "write_file")]
    assert [json.loads(a) for a in arguments] == [
        {"city": "Paris", "days": 3}, {"path": "a.py", "content": CODE}
    ]
    assert len([d for d in deltas if d.index == 1]) > 5  # the file's text streamed
