"""The tag-syntax tool-call parsers (Qwen3-Coder, GLM-4.5, MiniMax M2, DeepSeek V3.2) on canned
model text, whole and streamed, their values typed by the request's schemas (DeepSeek V3.2's
by their tags); and through the server."""

from __future__ import annotations

import json
import random

import pytest
from fake_engine import ToolTemplateTokenizer
from test_tool_parsers import incomplete, split_at_random, stream, stream_pieces
from tool_call_checks import (
    CONTENT,
    check_anthropic_tool_use,
    check_streamed_deltas,
    check_whole_response,
    scripted_client,
)

from server.core.tag_tool_parsers import (
    DeepSeekV32Parser,
    Glm45Parser,
    MiniMaxM2Parser,
    Qwen3CoderParser,
)
from server.core.tool_call_stream import ToolCallStream
from server.core.tool_parser_choice import parser_for_template, parser_named
from server.core.tool_parsers import HermesParser, ParsedCall

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "ratio": {"type": "number"},
            "metric": {"type": "boolean"},
            "where": {"type": "object"},
            "hours": {"type": "array", "items": {"type": "integer"}},
            "zone": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "limit": {"type": ["integer", "null"]},
        },
    },
    "write_file": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    },
}
QWEN = Qwen3CoderParser(SCHEMAS)
GLM = Glm45Parser(SCHEMAS)
MINIMAX = MiniMaxM2Parser(SCHEMAS)
DSML = DeepSeekV32Parser(SCHEMAS)
CODE = 'if a < b:\n    print("<b>", a)\n'  # quotes, tags and a last newline of its own


def qwen_call(name: str, **params: str) -> str:
    """A call as Qwen3-Coder writes it: each value between newlines."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def glm_call(name: str, compact: bool = False, **params: str) -> str:
    """A call as GLM-4.5 writes it (newlines between the tags), or GLM-4.7 (none)."""
    sep = "" if compact else "\n"
    body = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}"
                   for k, v in params.items())  # fmt: skip
    return f"<tool_call>{name}{sep}{body}</tool_call>"


def minimax_calls(*calls: tuple[str, dict[str, str]]) -> str:
    """A block of calls as MiniMax M2 writes it: `(name, params)` each."""
    invokes = "".join(f'<invoke name="{name}">\n' + "".join(
        f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items()) + "</invoke>\n"
        for name, params in calls)  # fmt: skip
    return f"<minimax:tool_call>\n{invokes}</minimax:tool_call>"


def minimax_call(name: str, **params: str) -> str:
    return minimax_calls((name, params))


def dsml_calls(*calls: tuple[str, dict]) -> str:
    """A block of calls as DeepSeek V3.2's encoding writes it (encoding_dsv32.py): a string
    value as it is, any other as JSON, the tag saying which."""
    def parameter(key, value):
        text = value if isinstance(value, str) else json.dumps(value)
        return (f'<｜DSML｜parameter name="{key}" string="{str(isinstance(value, str)).lower()}">'
                f"{text}</｜DSML｜parameter>")

    invokes = "\n".join(f'<｜DSML｜invoke name="{name}">\n'
                        + "\n".join(parameter(k, v) for k, v in params.items())
                        + "\n</｜DSML｜invoke>" for name, params in calls)  # fmt: skip
    return f"\n\n<｜DSML｜function_calls>\n{invokes}\n</｜DSML｜function_calls>"


def dsml_call(name: str, **params) -> str:
    return dsml_calls((name, params))


CALLS = {QWEN: qwen_call, GLM: glm_call, MINIMAX: minimax_call, DSML: dsml_call}
FAMILIES = [QWEN, GLM, MINIMAX, DSML]
FAMILY_IDS = ["qwen3_coder", "glm45", "minimax_m2", "deepseek_v32"]

WEATHER = ParsedCall("get_weather", '{"city": "Paris", "days": 3}')
WRITE = ParsedCall("write_file", json.dumps({"path": "a.py", "content": CODE}))

# (parser, model text, expected content, expected calls)
CASES = [
    (QWEN, qwen_call("get_weather", city="Paris", days="3"), "", [WEATHER]),
    (
        QWEN,
        "Let me check.\n\n" + qwen_call("get_weather", city="Paris", days="3") + "\n"
        + qwen_call("write_file", path="a.py", content=CODE),
        "Let me check.\n\n",
        [WEATHER, WRITE],
    ),
    (GLM, glm_call("get_weather", city="Paris", days="3"), "", [WEATHER]),
    (GLM, glm_call("get_weather", compact=True, city="Paris", days="3"), "", [WEATHER]),
    (
        GLM,
        "On it.\n" + glm_call("get_weather", city="Paris", days="3") + "\n"
        + glm_call("write_file", path="a.py", content=CODE),
        "On it.\n",
        [WEATHER, WRITE],
    ),
    (GLM, "<tool_call>get_time</tool_call>", "", [ParsedCall("get_time", "{}")]),
    (MINIMAX, minimax_call("get_weather", city="Paris", days="3"), "", [WEATHER]),
    (
        MINIMAX,
        "Checking both.\n" + minimax_calls(("get_weather", {"city": "Paris", "days": "3"}),
                                            ("write_file", {"path": "a.py", "content": CODE})),
        "Checking both.\n",
        [WEATHER, WRITE],
    ),
    (MINIMAX, minimax_call("get_weather", city="Paris", days="3") + "\n"
     + minimax_call("write_file", path="a.py", content=CODE), "", [WEATHER, WRITE]),
    (MINIMAX, '<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>',
     "", [ParsedCall("get_time", "{}")]),
    (MINIMAX, "Not needed: <invoke> is a word.", "Not needed: <invoke> is a word.", []),
    (DSML, dsml_call("get_weather", city="Paris", days=3), "", [WEATHER]),
    (
        DSML,
        "Checking both." + dsml_calls(("get_weather", {"city": "Paris", "days": 3}),
                                      ("write_file", {"path": "a.py", "content": CODE})),
        "Checking both.",
        [WEATHER, WRITE],
    ),
    (DSML, dsml_call("get_time"), "", [ParsedCall("get_time", "{}")]),
    (DSML, "Not needed: <｜DSML｜ is a word.", "Not needed: <｜DSML｜ is a word.", []),
    (QWEN, "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "",
     [ParsedCall("get_time", "{}")]),  # fmt: skip
    (QWEN, "Not needed: 2 < 3, <b>bold</b>.", "Not needed: 2 < 3, <b>bold</b>.", []),
    (GLM, "<tool_call>I will call it.</tool_call>", "<tool_call>I will call it.</tool_call>", []),
    (QWEN, "<tool_call>I will call it.</tool_call>", "<tool_call>I will call it.</tool_call>", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_text(parser, text, content, calls):
    assert stream(parser, [text]) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_one_character_at_a_time(parser, text, content, calls):
    # Content once sent is never taken back: a right final content means no tag, nor a
    # tag's first characters, ever reached the client.
    assert stream(parser, [*text, ""]) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_at_random_boundaries(parser, text, content, calls):
    rng = random.Random(11)
    for _ in range(30):
        assert stream(parser, split_at_random(text, rng)) == (content, calls)


@pytest.mark.parametrize("parser", FAMILIES, ids=FAMILY_IDS)
def test_every_split_in_two_gives_the_same_calls(parser):
    call = CALLS[parser]
    text = "Hi. " + call("write_file", path="a.py", content=CODE)
    for cut in range(1, len(text)):
        assert stream(parser, [text[:cut], text[cut:]]) == ("Hi. ", [WRITE])


@pytest.mark.parametrize("parser", FAMILIES, ids=FAMILY_IDS)
def test_a_string_value_streams_as_written_after_the_name(parser):
    content = "".join(f"line {i}\n" for i in range(30))
    call = CALLS[parser]
    _, calls, pieces = stream_pieces(parser, [*call("write_file", path="a.py", content=content)])
    assert calls == [ParsedCall("write_file", json.dumps({"path": "a.py", "content": content}))]
    assert [p.name for p in pieces if p.name] == ["write_file"]  # once, and whole
    assert len([p for p in pieces if p.arguments]) > len(content) // 2


@pytest.mark.parametrize("parser", FAMILIES, ids=FAMILY_IDS)
def test_values_of_awkward_text_stream_as_they_parse_whole(parser):
    """Values of newlines, quotes, backslashes and tag-like text, the call cut anywhere or
    not: streamed at random boundaries, the same content and calls as the whole text."""
    rng = random.Random(5)
    alphabet = ["a", "\n", "<", ">", '"', "\\", " ", "</", "parameter", "arg_value", "é", "\t",
                "invoke"]
    call = CALLS[parser]
    for _ in range(150):
        words = ("".join(rng.choices(alphabet, k=rng.randint(0, 10))) for _ in range(2))
        path, content = (w.replace("</parameter>", "").replace("</arg_value>", "") for w in words)
        text = "x" + call("write_file", path=path, content=content)
        cut = rng.random() < 0.3
        text = text[: rng.randint(1, len(text))] if cut else text
        whole = stream_pieces(parser, [text])
        if not cut:
            assert whole[1] == [ParsedCall("write_file", json.dumps(
                {"path": path, "content": content}, ensure_ascii=False))]  # fmt: skip
        for _ in range(4):
            streamed = stream_pieces(parser, split_at_random(text, rng))
            assert streamed[:2] == whole[:2]
            assert incomplete(streamed[2]) == incomplete(whole[2])


def test_a_long_string_value_streams_without_parsing_the_region_again():
    class CountingParser(Qwen3CoderParser):
        scans = 0

        def scan(self, text, pos):
            self.scans += 1
            return super().scan(text, pos)

    parser = CountingParser(SCHEMAS)
    text = qwen_call("write_file", content="".join(f"x = {i}\n\n" for i in range(300)))
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    assert stream(parser, pieces)[1][0].name == "write_file"
    assert parser.scans < len(pieces) // 2


def test_values_take_the_type_their_schema_declares():
    params = {
        "city": "3", "days": "3", "ratio": "0.5", "metric": "true", "where": '{"lat": 48.9}',
        "hours": "[9, 12]", "zone": "null", "limit": "null", "wind": "12",
    }  # fmt: skip
    expected = {
        "city": "3", "days": 3, "ratio": 0.5, "metric": True, "where": {"lat": 48.9},
        "hours": [9, 12], "zone": "null", "limit": None, "wind": "12",  # wind: not in schema
    }  # fmt: skip
    for parser, text in ((QWEN, qwen_call("get_weather", **params)),
                         (GLM, glm_call("get_weather", **params))):  # fmt: skip
        for pieces in ([text], [*text, ""]):
            (call,) = stream(parser, pieces)[1]
            assert json.loads(call.arguments) == expected


def test_deepseek_v32_values_take_the_type_their_tag_says():
    text = dsml_call("get_weather", hours=[9, 12], where={"lat": 48.9}, days="3", metric=True,
                     zone=None)  # days: a string, though the schema says integer
    unparsed = text.replace("null</", "windy</")  # string="false", yet no JSON: stays text
    expected = {"hours": [9, 12], "where": {"lat": 48.9}, "days": "3", "metric": True}
    for pieces in ([text], [*text, ""]):
        (call,) = stream(DSML, pieces)[1]
        assert json.loads(call.arguments) == {**expected, "zone": None}
    (call,) = stream(DSML, [unparsed])[1]
    assert json.loads(call.arguments) == {**expected, "zone": "windy"}


def test_a_value_that_does_not_parse_as_its_type_stays_text():
    text = qwen_call("get_weather", days="three", metric="True", hours="[9,")
    (call,) = stream(QWEN, [text])[1]
    assert json.loads(call.arguments) == {"days": "three", "metric": "True", "hours": "[9,"}


def test_without_schemas_every_value_is_text():
    text = qwen_call("get_weather", city="Paris", days="3")
    assert stream(Qwen3CoderParser(), [text])[1] == [
        ParsedCall("get_weather", '{"city": "Paris", "days": "3"}')
    ]
    assert parser_named("glm45").for_tools(SCHEMAS).schemas == SCHEMAS
    assert HermesParser().for_tools(SCHEMAS).__class__ is HermesParser


def test_only_the_newlines_the_template_adds_are_stripped():
    text = qwen_call("write_file", content="\n  indented\n")
    (call,) = stream(QWEN, [text])[1]
    assert json.loads(call.arguments) == {"content": "\n  indented\n"}
    (call,) = stream(GLM, [glm_call("write_file", content="\nx\n")])[1]
    assert json.loads(call.arguments) == {"content": "\nx\n"}  # GLM adds none


@pytest.mark.parametrize(
    ("parser", "text", "arguments"),
    [
        (QWEN, "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", '{"city": "Par'),
        (QWEN, "<tool_call>\n<function=get_weather>\n<parameter=days>\n3", '{"days": '),
        (GLM, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", '{"city": "Par'),
        (QWEN, "<tool_call>\n<function=get_weather>\nParis\n</function></tool_call>", "{"),
        (GLM, "<tool_call>get_weather\n<arg_key>city</arg_key>Paris</tool_call>", "{"),
        (DSML, '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
               '<｜DSML｜parameter name="city" string="true">Par', '{"city": "Par'),
        (DSML, '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
               '<｜DSML｜parameter name="days" string="false">3', '{"days": '),
        # A parameter tag without its string attribute is no DSML.
        (DSML, '<｜DSML｜function_calls><｜DSML｜invoke name="get_weather"><｜DSML｜parameter '
               'name="city">Paris</｜DSML｜parameter></｜DSML｜invoke>', "{"),
    ],
)
def test_a_call_that_began_but_never_parsed_ends_incomplete(parser, text, arguments):
    for pieces in ([text], [*text, ""], [*text]):
        content, calls, seen = stream_pieces(parser, pieces)
        assert (content, calls, incomplete(seen)) == ("", [ParsedCall("get_weather", arguments)],
                                                      [0])  # fmt: skip


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (QWEN, qwen_call("get_weather", city="Paris", days="3").removesuffix("</tool_call>")),
        (QWEN, qwen_call("get_weather", city="Paris", days="3")[: -len("on>\n</tool_call>")]),
        (GLM, glm_call("get_weather", city="Paris", days="3").removesuffix("</tool_call>")),
    ],
)
def test_closing_tags_missing_at_the_end_are_forgiven(parser, text):
    for pieces in ([text], [*text, ""]):
        content, calls, seen = stream_pieces(parser, pieces)
        assert (content, calls, incomplete(seen)) == ("", [WEATHER], [])


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (QWEN, "Sure.<tool_call>\n<function=get_wea"),
        (QWEN, "Sure.<tool_call>\n"),
        (GLM, "Sure.<tool_call>get_wea"),
        (DSML, 'Sure.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_wea'),
    ],
)
def test_a_call_cut_before_its_name_leaves_no_markup(parser, text):
    assert stream(parser, [text]) == ("Sure.", [])
    assert stream(parser, [*text, ""]) == ("Sure.", [])


def test_no_tag_fragment_reaches_the_content_while_streaming():
    text = "I'll look. " + qwen_call("get_weather", city="Paris") + " Done?"
    calls_stream = ToolCallStream(QWEN)
    contents = [calls_stream.feed(ch, final=False)[0] for ch in text]
    assert "".join(contents) == "I'll look. "


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        # Qwen3-Coder's: its tool instructions and history both write `<tool_call>` too.
        ("{{- '<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>"
         "\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}{%- for args_name, args_value"
         " in tool_call.arguments|items %}{{- '<parameter=' + args_name + '>\\n' }}",
         Qwen3CoderParser),
        # GLM-4.5's instructions, and GLM-4.7's compact history.
        ("<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}"
         "</arg_value>\n</tool_call>", Glm45Parser),
        ("{{- '<tool_call>' + tc.name -}}{% for k, v in _args.items() %}<arg_key>{{ k }}"
         "</arg_key><arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>", Glm45Parser),
        # Qwen3's JSON calls stay Hermes.
        ('<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'
         "\\n</tool_call>", HermesParser),
        # MiniMax M2's.
        ("{{- '<minimax:tool_call>\\n' }}{%- for tool_call in message.tool_calls -%}"
         "<invoke name=\"{{ tool_call.name }}\">", MiniMaxM2Parser),
        # DeepSeek V3.2's (it publishes its encoding in Python; community Jinja ports set the
        # same token).
        ('{%- set dsml_token = "｜DSML｜" -%}{{ "\\n\\n" }}<{{ dsml_token }}function_calls>'
         "{%- for tool_call in message.tool_calls -%}", DeepSeekV32Parser),
    ],
)  # fmt: skip
def test_the_chat_template_picks_the_family(template, parser):
    assert type(parser_for_template(template)) is parser


def test_the_families_are_named():
    for parser in FAMILIES:
        assert type(parser_named(parser.name)) is type(parser)


# ---- through the server ---------------------------------------------------------------------


class Qwen3CoderTokenizer(ToolTemplateTokenizer):
    chat_template = "{{- '<parameter=' + args_name + '>\\n' }}<tool_call>{% for t in tools %}"


class Glm45Tokenizer(ToolTemplateTokenizer):
    chat_template = "<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key>{% for t in tools %}"


class MiniMaxTokenizer(ToolTemplateTokenizer):
    chat_template = "<minimax:tool_call>{% for t in tools %}<invoke name=\"{{ t }}\">"


class DsmlTokenizer(ToolTemplateTokenizer):
    chat_template = "<｜DSML｜function_calls>{% for t in tools %}<｜DSML｜invoke name=\"{{ t }}\">"


TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}}
         for name, schema in SCHEMAS.items()]  # fmt: skip


@pytest.fixture(params=FAMILY_IDS)
def scripted_server(request):
    """A server whose model answers with some text, then two calls in its family's tags, in
    pieces of 3 characters."""
    tokenizer, calls = {"qwen3_coder": (Qwen3CoderTokenizer(), qwen_call),
                        "glm45": (Glm45Tokenizer(), glm_call),
                        "minimax_m2": (MiniMaxTokenizer(), minimax_call),
                        "deepseek_v32": (DsmlTokenizer(), dsml_call)}[request.param]
    # DeepSeek V3.2 writes the number as JSON, the others as the text its schema types.
    days = 3 if request.param == "deepseek_v32" else "3"
    text = CONTENT + calls("get_weather", city="Paris", days=days) + calls(
        "write_file", path="a.py", content=CODE
    )
    with scripted_client(tokenizer, text) as client:
        yield client


def test_calls_in_a_whole_response(scripted_server):
    check_whole_response(scripted_server, TOOLS, CODE)


def test_calls_streamed_as_tool_call_deltas(scripted_server):
    check_streamed_deltas(scripted_server, TOOLS, CODE)


def test_calls_as_anthropic_tool_use_blocks_whole_and_streamed(scripted_server):
    check_anthropic_tool_use(scripted_server, TOOLS, CODE)
