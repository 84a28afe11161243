"""HarmonyTurnParser on token ids cut where a model's steps cut them: the pieces it hands out
join to the turn's reasoning, content and calls however the tokens arrive."""

from __future__ import annotations

import pytest
from harmony_tokenizer import gpt_oss_tokenizer

from metal_engine.outputs import RequestOutput
from server.core.harmony_encoding import harmony_encoding
from server.core.harmony_parsing import HarmonyTurnParser

CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city": "Paris — ville lumière"}<|call|>'
)
PREAMBLE_AND_ANSWER = (
    "<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Sunny, 21 °C.<|return|>"
)


@pytest.fixture(scope="module")
def encoding():
    return harmony_encoding(gpt_oss_tokenizer())


def parse(encoding, text: str, per_output: int, reason: str = "stop", drop_last: int = 0):
    """Feed the turn `per_output` tokens at a time; what the parser handed out, joined."""
    ids = encoding.encode(text, allowed_special="all")
    ids = ids[: len(ids) - drop_last]
    parser = HarmonyTurnParser(encoding)
    reasoning, content, calls = "", "", []
    for start in range(0, len(ids), per_output):
        last = start + per_output >= len(ids)
        output = RequestOutput("r", ids[start : start + per_output], "", reason if last else None,
                               1, start + per_output)  # fmt: skip
        piece = parser.feed(output)
        reasoning, content = reasoning + piece.reasoning, content + piece.content
        for call in piece.calls:
            if call.name is not None:
                calls.append({"name": call.name, "arguments": "", "done": None})
            calls[call.index]["arguments"] += call.arguments
            if call.done:
                calls[call.index]["done"] = call.complete
    return reasoning, content, calls


@pytest.mark.parametrize("per_output", [1, 2, 5, 1000])
def test_analysis_then_a_call(encoding, per_output):
    reasoning, content, calls = parse(encoding, CALL, per_output)
    assert reasoning == "Need the weather."
    assert content == ""
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris — ville lumière"}',
                      "done": True}]  # fmt: skip


@pytest.mark.parametrize("per_output", [1, 3])
def test_a_preamble_and_the_final_answer_are_content(encoding, per_output):
    assert parse(encoding, PREAMBLE_AND_ANSWER, per_output) == ("", "Checking.Sunny, 21 °C.", [])


def test_a_call_cut_by_the_length_limit_ends_incomplete(encoding):
    _, _, calls = parse(encoding, CALL, 1, reason="length", drop_last=4)
    assert calls[0]["name"] == "get_weather" and calls[0]["done"] is False


def test_tokens_that_are_no_harmony_become_content(encoding):
    reasoning, content, calls = parse(encoding, "<|message|><|message|>oops", 1)
    assert (reasoning, calls) == ("", [])
    assert "oops" in content
