"""DeepSeek V3.1's, Kimi K2's and Mistral's tool calls (special tokens around JSON arguments)
on their real markup, whole and streamed at every split; and through the server with the
openai client."""

from __future__ import annotations

import json
import random

import pytest
from fake_engine import ToolTemplateTokenizer
from test_tool_parsers import incomplete, split_at_random, stream, stream_pieces
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tool_call_checks import (
    CONTENT,
    MESSAGES,
    check_anthropic_tool_use,
    check_streamed_deltas,
    check_whole_response,
    scripted_client,
)
from transformers import PreTrainedTokenizerFast

from metal_engine.detokenizer import IncrementalDetokenizer
from metal_engine.outputs import RequestOutput
from scheduler.sampling_params import SamplingParams
from server.core.chat_format import prepare_chat
from server.core.chat_request import ChatCompletionRequest
from server.core.token_tool_parsers import DeepSeekV31Parser, KimiK2Parser, MistralParser
from server.core.tool_parser_choice import parser_for_template, parser_named
from server.core.tool_parsers import ParsedCall

DEEPSEEK, KIMI, MISTRAL = DeepSeekV31Parser(), KimiK2Parser(), MistralParser()
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


def mistral_calls(*calls: tuple[str, str]) -> str:
    """Calls as Mistral's v13+ templates write them: no section, no end token."""
    return "".join(f"[TOOL_CALLS]{name}[ARGS]{arguments}" for name, arguments in calls)


WEATHER = ParsedCall("get_weather", '{"city": "Paris", "days": 3}')
WRITE = ParsedCall("write_file", json.dumps({"path": "a.py", "content": CODE}))
BOTH = ((WEATHER.name, WEATHER.arguments), (WRITE.name, WRITE.arguments))
FAMILIES = [(DEEPSEEK, deepseek_calls), (KIMI, kimi_calls), (MISTRAL, mistral_calls)]
IDS = ["deepseek_v31", "kimi_k2", "mistral"]

CASES = [
    *[(parser, calls((WEATHER.name, WEATHER.arguments)), "", [WEATHER])
      for parser, calls in FAMILIES],
    *[(parser, "Let me check.\n\n" + calls(*BOTH), "Let me check.\n\n", [WEATHER, WRITE])
      for parser, calls in FAMILIES],
    *[(parser, calls(("get_time", "{}")), "", [ParsedCall("get_time", "{}")])
      for parser, calls in FAMILIES],
    (DEEPSEEK, "Not needed: 2 < 3, <b>bold</b>.", "Not needed: 2 < 3, <b>bold</b>.", []),
    (KIMI, "Not needed: a <|b|> c.", "Not needed: a <|b|> c.", []),
    (MISTRAL, "Not needed: [ARGS] {1}.", "Not needed: [ARGS] {1}.", []),
    # Tokenizer v11 names the call's id before its arguments.
    (MISTRAL, '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "days": 3}',
     "", [WEATHER]),
    # The JSON object ends the call: text after the last one is content again.
    (MISTRAL, mistral_calls((WEATHER.name, WEATHER.arguments)) + " Done.", " Done.", [WEATHER]),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_streamed_by_character_and_at_random_boundaries(parser, text, content, calls):
    # Content once sent is never taken back: no token, nor its first characters, reached it.
    rng = random.Random(11)
    for pieces in ([text], [*text, ""], *(split_at_random(text, rng) for _ in range(30))):
        assert stream(parser, pieces) == (content, calls)


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
        (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', '{"city": "Par'),
        (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": }', '{"city": }'),
    ],
)  # fmt: skip
def test_a_call_cut_in_its_arguments_ends_incomplete(parser, text, arguments):
    for pieces in ([text], [*text, ""]):
        content, calls, seen = stream_pieces(parser, pieces)
        assert (content, calls, incomplete(seen)) == ("", [ParsedCall("get_weather", arguments)],
                                                      [0])  # fmt: skip


@pytest.mark.parametrize(("parser", "calls"), FAMILIES[:2], ids=IDS[:2])
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
        (MISTRAL, "Sure.[TOOL_CALLS]get_wea"),
        (MISTRAL, "Sure.[TOOL_CALLS]get_weather[ARGS]"),
        (MISTRAL, 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]write_fi'),
    ],
)
def test_a_call_cut_before_its_arguments_leaves_no_markup(parser, text):
    calls = [ParsedCall("get_weather", '{"city": "Paris"}')] if "}" in text else []
    assert stream(parser, [text]) == ("Sure.", calls)
    assert stream(parser, [*text, ""]) == ("Sure.", calls)


def test_mistral_s_older_array_of_calls_is_still_read():
    text = "[TOOL_CALLS][" + ", ".join(json.dumps({"name": c.name, "arguments": json.loads(
        c.arguments)}) for c in (WEATHER, WRITE)) + "]"  # fmt: skip
    for pieces in ([text], [*text, ""]):
        assert stream(MISTRAL, pieces) == ("", [WEATHER, WRITE])


@pytest.mark.parametrize(
    ("template", "parser"),
    [  # the templates' own text for a call
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + "
         "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}",
         DeepSeekV31Parser),
        ("{{- '<|tool_calls_section_begin|>' -}}{%- for tool_call in message['tool_calls'] -%}"
         "<|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>", KimiK2Parser),
        ("{%- for tool in message['tool_calls'] %}{{- '[TOOL_CALLS]' }}{%- set name = "
         "tool['function']['name'] %}{{- name + '[ARGS]' + arguments }}", MistralParser),
    ],
)  # fmt: skip
def test_the_chat_template_or_the_name_picks_the_family(template, parser):
    assert type(parser_for_template(template)) is parser
    assert type(parser_named(parser.name)) is parser


# ---- through the server ---------------------------------------------------------------------


class DeepSeekTokenizer(ToolTemplateTokenizer):
    chat_template = "{{'<｜tool▁calls▁begin｜>'}}{% for t in tools %}{% endfor %}"


class KimiTokenizer(ToolTemplateTokenizer):
    chat_template = "{{ '<|tool_calls_section_begin|>' }}{% for t in tools %}{% endfor %}"


class MistralTokenizer(ToolTemplateTokenizer):
    chat_template = ("{% for t in tools %}{% endfor %}{{- '[TOOL_CALLS]' }}{{- name + '[ARGS]' }}"
                     "{{- '[THINK]' + block['thinking'] + '[/THINK]' }}")


TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "write_file")]  # fmt: skip


@pytest.fixture(params=IDS)
def scripted_server(request):
    """A server whose model answers with some text, then two calls in its family's tokens,
    in pieces of 3 characters."""
    tokenizer, calls = {"deepseek_v31": (DeepSeekTokenizer(), deepseek_calls),
                        "kimi_k2": (KimiTokenizer(), kimi_calls),
                        "mistral": (MistralTokenizer(), mistral_calls)}[request.param]
    text = CONTENT + calls(*BOTH)
    with scripted_client(tokenizer, text) as client:
        yield client


def test_calls_in_a_whole_response(scripted_server):
    check_whole_response(scripted_server, TOOLS, CODE)


def test_calls_streamed_as_tool_call_deltas(scripted_server):
    check_streamed_deltas(scripted_server, TOOLS, CODE)


def test_calls_as_anthropic_tool_use_blocks_whole_and_streamed(scripted_server):
    check_anthropic_tool_use(scripted_server, TOOLS, CODE)


def test_mistral_reasoning_then_calls_whole_and_streamed():
    text = "[THINK]The weather tool, then the file.[/THINK]" + CONTENT + mistral_calls(*BOTH)
    with scripted_client(MistralTokenizer(), text) as client:
        reply = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS)
        message = reply.choices[0].message
        assert message.model_extra["reasoning_content"] == "The weather tool, then the file."
        assert message.content == CONTENT
        assert [c.function.name for c in message.tool_calls] == ["get_weather", "write_file"]
        chunks = [c for c in client.chat.completions.create(
            model="default", messages=MESSAGES, tools=TOOLS, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        "The weather tool, then the file."
    assert "".join(d.content or "" for d in deltas) == CONTENT
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [t.function.name for t in calls if t.function.name] == ["get_weather", "write_file"]


# ---- Mistral's markup is special tokens ------------------------------------------------------


def tekken_style_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with Mistral's control tokens as special tokens (as transformers
    converts a tekken.json), and a v13-style template with tools and thinking chunks."""
    controls = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]",
                "[/THINK]"]  # fmt: skip
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ['get_weather {"city": "Paris", "days": 3} Checking the weather first.'] * 20
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=controls,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")  # fmt: skip
    tokenizer.chat_template = (
        "<s>{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
        "{% elif m['role'] == 'assistant' %}{% for block in m.get('thinking', []) %}"
        "{{- '[THINK]' + block['thinking'] + '[/THINK]' }}{% endfor %}{{ m['content'] }}"
        "{% for tool in m.get('tool_calls', []) %}{{- '[TOOL_CALLS]' }}"
        "{{- tool['function']['name'] + '[ARGS]' + tool['function']['arguments'] }}"
        "{% endfor %}</s>{% endif %}{% endfor %}"
    )
    return tokenizer


def test_mistral_s_special_markup_reaches_the_parser_through_the_detokenizer():
    """Decoding skips special tokens, which would leave `get_weather{...}` of a Mistral call:
    the chat format has the detokenizer write out those its parsers read, and no other."""
    tokenizer = tekken_style_tokenizer()
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES,
                                                 "tools": TOOLS})  # fmt: skip
    prepared = prepare_chat(tokenizer, chat, None)
    params = prepared.with_format(SamplingParams())
    shown = {tokenizer.convert_ids_to_tokens(i) for i in params.shown_special_ids}
    assert shown == {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"}
    answer = ('[THINK]The weather first.[/THINK]Checking.[TOOL_CALLS]get_weather[ARGS]'
              '{"city": "Paris", "days": 3}</s>')
    ids = tokenizer.encode(answer, add_special_tokens=False)
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    assert len([i for i in ids if i in special]) == 5  # the markup, and </s>

    def answered(shown_ids: tuple[int, ...]) -> tuple[str, str, list]:
        detokenizer = IncrementalDetokenizer(tokenizer, prepared.ids, (), shown_ids)
        parser, reasoning, content, calls = prepared.new_parser(), "", "", []
        for n, token in enumerate(ids, 1):
            detokenizer.add_token(token)
            final = n == len(ids)
            piece = parser.feed(RequestOutput("r", [token], detokenizer.take_delta(final),
                                              "stop" if final else None, len(prepared.ids), n))
            reasoning, content = reasoning + piece.reasoning, content + piece.content
            calls += [(c.name, c.arguments) for c in piece.calls]
        return reasoning, content, calls

    reasoning, content, calls = answered(params.shown_special_ids)
    assert (reasoning, content) == ("The weather first.", "Checking.")
    assert calls[0][0] == "get_weather"
    assert json.loads("".join(a for _, a in calls)) == {"city": "Paris", "days": 3}
    # Skipped, the markup is lost: the call and the reasoning come out as plain text.
    assert answered(()) == ("", 'The weather first.Checking.get_weather{"city": "Paris", '
                                '"days": 3}', [])  # fmt: skip
