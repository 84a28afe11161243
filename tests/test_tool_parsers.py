"""Tool-call parsers and the reasoning splitter on canned model text, whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from server.core.reasoning import MISTRAL_THINK, THINK, ReasoningStream, think_tags
from server.core.token_tool_parsers import MistralParser
from server.core.tool_call_stream import CallPiece, ToolCallStream
from server.core.tool_parser_choice import parser_for_template, parser_named
from server.core.tool_parsers import (
    ForcedCallParser,
    HermesParser,
    Llama3JsonParser,
    ParsedCall,
    ToolParser,
)

WEATHER = ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ParsedCall("get_time", '{"zone": "Europe/Paris, \\"CET\\""}')

# (parser, model text, expected content, expected calls)
CASES = [
    (
        HermesParser(),
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        "",
        [WEATHER],
    ),
    (
        HermesParser(),
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": '
        '{"zone": "Europe/Paris, \\"CET\\""}}</tool_call>',
        "Let me check.\n",
        [WEATHER, TIME],
    ),
    (
        Llama3JsonParser(),
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [WEATHER],
    ),
    (
        Llama3JsonParser(),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {"zone": "Europe/Paris, \\"CET\\""}}',
        "",
        [WEATHER, TIME],
    ),
    (
        MistralParser(),
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {"zone": "Europe/Paris, \\"CET\\""}}]',
        "",
        [WEATHER, TIME],
    ),
    (  # [TOOL_CALLS] is a special token that detokenizing drops
        MistralParser(),
        ' [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        "",
        [WEATHER],
    ),
    (
        ForcedCallParser(),
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
        "",
        [WEATHER],
    ),
    (HermesParser(), "Not needed: 2 < 3, <b>bold</b>.", "Not needed: 2 < 3, <b>bold</b>.", []),
    (Llama3JsonParser(), "The answer is {42}.", "The answer is {42}.", []),
    (MistralParser(), "[1, 2] are numbers.", "[1, 2] are numbers.", []),
]


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    """Feed `pieces` in order (the last one as final); return the content and the calls, each
    joined from its pieces (which must name it first and end it once)."""
    return stream_pieces(parser, pieces)[:2]


def stream_pieces(
    parser: ToolParser, pieces: list[str]
) -> tuple[str, list[ParsedCall], list[CallPiece]]:
    calls_stream = ToolCallStream(parser)
    content, names, arguments, ended, seen = "", [], [], [], []
    for i, piece in enumerate(pieces):
        new_content, new_pieces = calls_stream.feed(piece, final=i == len(pieces) - 1)
        content += new_content
        for call in new_pieces:
            if call.name is not None:
                assert call.index == len(names)
                names.append(call.name)
                arguments.append("")
            assert call.index not in ended
            arguments[call.index] += call.arguments
            if call.done:
                ended.append(call.index)
        seen += new_pieces
    assert ended == list(range(len(names)))
    return content, [ParsedCall(n, a) for n, a in zip(names, arguments, strict=True)], seen


def incomplete(pieces: list[CallPiece]) -> list[int]:
    return [piece.index for piece in pieces if piece.done and not piece.complete]


def split_at_random(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_text(parser, text, content, calls):
    assert stream(parser, [text]) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_one_character_at_a_time(parser, text, content, calls):
    # Deltas once sent are never taken back, so a right final content means no call syntax
    # (not even a marker's first characters) ever reached the client.
    assert stream(parser, [*text, ""]) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_at_random_boundaries(parser, text, content, calls):
    rng = random.Random(7)
    for _ in range(30):
        assert stream(parser, split_at_random(text, rng)) == (content, calls)


def test_calls_come_out_as_soon_as_they_close():
    text = CASES[1][1]
    first_close = text.index("</tool_call>") + len("</tool_call>")
    calls_stream = ToolCallStream(HermesParser())
    content, pieces = calls_stream.feed(text[:first_close], final=False)
    assert content == "Let me check.\n"
    assert pieces == [CallPiece(0, WEATHER.name, WEATHER.arguments, done=True)]
    assert calls_stream.feed(text[first_close:], final=False) == (
        "", [CallPiece(1, TIME.name, TIME.arguments, done=True)]
    )


def test_a_call_streams_its_name_once_complete_then_its_arguments_as_written():
    content = "x = 1\\n" * 40
    arguments = json.dumps({"path": "a.py", "content": content})
    text = f'<tool_call>\n{{"name": "write_file", "arguments": {arguments}}}\n</tool_call>'
    _, calls, pieces = stream_pieces(HermesParser(), [*text, ""])
    assert calls == [ParsedCall("write_file", arguments)]
    assert [p.name for p in pieces if p.name] == ["write_file"]  # never a partial name
    assert len([p for p in pieces if p.arguments]) > 100
    assert not pieces[-1].arguments and pieces[-1].done  # the close tag only ends it


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", '
        '"parameters": {"zone": "CET"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ],
)
def test_llama3_calls_stream_their_arguments(text):
    _, calls, pieces = stream_pieces(Llama3JsonParser(), [*text, ""])
    assert calls[0] == ParsedCall("get_weather", '{"city": "Paris"}')
    assert len([p for p in pieces if p.index == 0 and p.arguments]) > 5


def test_a_marker_split_across_deltas_is_held_back():
    calls_stream = ToolCallStream(HermesParser())
    assert calls_stream.feed("Sure.<tool", final=False) == ("Sure.", [])
    assert calls_stream.feed("_c", final=False) == ("", [])
    assert calls_stream.feed("ar is here", final=False) == ("<tool_car is here", [])


def test_text_that_is_no_call_is_returned_as_content():
    text = "<tool_call>I will call it.</tool_call>"
    assert stream(HermesParser(), [text]) == (text, [])
    assert stream(HermesParser(), [*text, ""]) == (text, [])
    never_closed = "Sure <tool_call>I will call it"  # not JSON: no call was cut here
    assert stream(HermesParser(), [never_closed]) == (never_closed, [])
    no_name = '{"arguments": {"city": "Paris"}}'
    assert stream(ForcedCallParser(), [no_name]) == (no_name, [])


@pytest.mark.parametrize(
    ("parser", "text", "arguments"),
    [
        (HermesParser(), '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
         '{"city": '),
        (ForcedCallParser(), '{"name": "get_weather", "arguments": {"city": }}', '{"city": }'),
        (HermesParser(), '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
         '{"city": "Par'),
    ],
)  # fmt: skip
def test_a_call_that_began_but_never_parsed_ends_incomplete(parser, text, arguments):
    """Malformed or cut short: whole or streamed, the same incomplete call (what was written
    of its arguments, never past a closing tag)."""
    for pieces in ([text], [*text, ""], [*text]):
        content, calls, seen = stream_pieces(parser, pieces)
        assert (content, calls, incomplete(seen)) == ("", [ParsedCall("get_weather", arguments)],
                                                      [0])  # fmt: skip


def test_the_final_delta_s_text_reaches_the_call():
    text = '<tool_call>{"name": "write", "arguments": {"content": "xyz'
    assert stream(HermesParser(), [text[:-2], text[-2:]])[1] == [
        ParsedCall("write", '{"content": "xyz')
    ]
    whole = '<tool_call>{"name": "write", "arguments": {"a": 1}}</tool_call>'
    assert stream(HermesParser(), ["Hi", whole])[1] == [ParsedCall("write", '{"a": 1}')]


def test_raw_newlines_inside_strings_still_parse():
    arguments = '{"content": "line 1\nline 2\ttabbed"}'.replace("\\n", "\n")
    text = f'<tool_call>{{"name": "write", "arguments": {arguments}}}</tool_call>'
    for pieces in ([text], [*text, ""]):
        content, calls, seen = stream_pieces(HermesParser(), pieces)
        assert (content, calls, incomplete(seen)) == ("", [ParsedCall("write", arguments)], [])


@pytest.mark.parametrize("text", ["<tool_call>{]", '{"name": "f", "parameters": {"a": ]}', "{[}"])
def test_json_the_partial_parser_chokes_on_is_no_error(text):
    for parser in (HermesParser(), Llama3JsonParser(), ForcedCallParser()):
        stream(parser, [*text])
        stream(parser, [text])


def test_arguments_given_as_json_text_are_accepted():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert stream(HermesParser(), [text])[1] == [ParsedCall("f", '{"x": 1}')]


def test_parser_from_template_or_name():
    assert isinstance(parser_for_template("{% for tool in tools %}<tool_call>"), HermesParser)
    assert isinstance(parser_for_template("{{ '[TOOL_CALLS]' }}"), MistralParser)
    assert isinstance(parser_for_template("{{- '<|python_tag|>' }}"), Llama3JsonParser)
    assert parser_for_template("{{ message['content'] }}") is None
    assert isinstance(parser_named("mistral"), MistralParser)
    with pytest.raises(ValueError, match="hermes"):
        parser_named("nope")


def test_forced_call_arguments_are_canonical_json():
    text = '{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}'
    (call,) = stream(ForcedCallParser(), [text])[1]
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}


# ---- reasoning ------------------------------------------------------------------------------


def reason(pieces: list[str], starts_inside: bool = False, tags=THINK) -> tuple[str, str]:
    splitter = ReasoningStream(starts_inside, tags)
    parts = [splitter.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize(
    ("text", "starts_inside", "expected"),
    [
        ("<think>2+2 is 4.</think>The answer is 4.", False, ("2+2 is 4.", "The answer is 4.")),
        ("\n<think>hm</think>\n\nYes.", False, ("hm", "\n\nYes.")),
        ("2+2 is 4.</think>Four.", True, ("2+2 is 4.", "Four.")),
        ("No thinking: <think> is a tag.", False, ("", "No thinking: <think> is a tag.")),
        ("<think>cut off", False, ("cut off", "")),
        ("<thin", False, ("", "<thin")),
    ],
)
def test_reasoning_is_split_whole_and_streamed(text, starts_inside, expected):
    assert reason([text], starts_inside) == expected
    assert reason([*text, ""], starts_inside) == expected
    rng = random.Random(3)
    for _ in range(20):
        assert reason(split_at_random(text, rng), starts_inside) == expected


def test_reasoning_markers_never_leak_into_deltas():
    splitter = ReasoningStream()
    text = "<think>a</think>b"
    deltas = [splitter.feed(ch, final=False) for ch in text]
    assert all("<" not in r + c for r, c in deltas)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[THINK]2+2 is 4.[/THINK]The answer is 4.", ("2+2 is 4.", "The answer is 4.")),
        ("[THINK]Weather first.[/THINK][TOOL_CALLS]get_weather[ARGS]{}",
         ("Weather first.", "[TOOL_CALLS]get_weather[ARGS]{}")),
        ("<think>not Mistral's</think>", ("", "<think>not Mistral's</think>")),
        ("[THINK]cut off", ("cut off", "")),
        ("[THI", ("", "[THI")),
    ],
)  # fmt: skip
def test_mistral_reasoning_is_split_at_every_boundary(text, expected):
    assert reason([text], tags=MISTRAL_THINK) == expected
    for cut in range(1, len(text)):
        assert reason([text[:cut], text[cut:]], tags=MISTRAL_THINK) == expected
    assert reason([*text, ""], tags=MISTRAL_THINK) == expected


def test_the_chat_template_picks_the_reasoning_tags():
    # Magistral's and Mistral Small 4's templates write thinking chunks so.
    assert think_tags("{{- '[THINK]' + block['thinking'] + '[/THINK]' }}") == MISTRAL_THINK
    assert think_tags("{{ '<think>' }}{{ message['content'] }}") == THINK
