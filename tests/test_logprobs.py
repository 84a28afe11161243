"""Logprob entries line up with the text the engine emits: multi-byte characters, stop
strings, EOS."""

from __future__ import annotations

from metal_engine.detokenizer import IncrementalDetokenizer
from metal_engine.outputs import RequestOutput, TokenLogprobs
from server.openai.logprobs import LogprobsAligner, chat_logprobs, completion_logprobs

PROMPT = "Say:"


def engine_outputs(tokenizer, token_ids: list[int], stop: tuple[str, ...] = ()):
    """One output per token, with the text the engine's detokenizer hands out."""
    prompt_ids = tokenizer.encode(PROMPT)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop)
    for i, token_id in enumerate(token_ids):
        last = detok.add_token(token_id) is not None or i == len(token_ids) - 1
        # The sampled token is the likeliest; the runner-up is some other token.
        top = [(token_id, -0.25), ((token_id + 1) % len(tokenizer), -1.5)]
        yield RequestOutput(
            "r", [token_id], detok.take_delta(final=last), "stop" if last else None,
            len(prompt_ids), i + 1, logprobs=[TokenLogprobs(token_id, -0.25, top)],
        )  # fmt: skip
        if last:
            return


def aligned(tokenizer, token_ids: list[int], stop: tuple[str, ...] = ()):
    aligner = LogprobsAligner(tokenizer, tokenizer.encode(PROMPT))
    text, entries = "", []
    for output in engine_outputs(tokenizer, token_ids, stop):
        text += output.new_text
        entries += aligner.feed(output)
        # Never ahead of the text: what was released is a prefix of what was emitted.
        assert text.startswith("".join(e.text for e in entries))
    return text, entries


def test_entries_join_to_the_text_across_multi_byte_characters(default_tokenizer):
    ids = default_tokenizer.encode("Tea 🍵 and café.", add_special_tokens=False)
    text, entries = aligned(default_tokenizer, ids)
    assert text == "Tea 🍵 and café." and "".join(e.text for e in entries) == text
    assert len(entries) == len(ids)
    assert "" in [e.text for e in entries]  # a token that only starts the emoji


def test_tokens_of_a_stop_string_and_eos_are_dropped(default_tokenizer):
    ids = default_tokenizer.encode("one two three STOP_HERE four", add_special_tokens=False)
    text, entries = aligned(default_tokenizer, ids, stop=("STOP_HERE",))
    assert text == "one two three "
    assert "".join(e.text for e in entries) == text
    words = default_tokenizer.encode("Hi there", add_special_tokens=False)
    text, entries = aligned(default_tokenizer, [*words, default_tokenizer.eos_token_id])
    assert text == "Hi there" and len(entries) == len(words)


def test_a_token_straddling_a_stop_string_is_cut(default_tokenizer):
    ids = default_tokenizer.encode(" hello world", add_special_tokens=False)
    text, entries = aligned(default_tokenizer, ids, stop=("lo w",))
    assert text == " hel" and "".join(e.text for e in entries) == " hel"


def test_api_shapes(default_tokenizer):
    ids = default_tokenizer.encode("Hi there", add_special_tokens=False)
    _, entries = aligned(default_tokenizer, ids)
    first = chat_logprobs(entries)[0]
    assert first.bytes == list(first.token.encode())
    assert [t.logprob for t in first.top_logprobs] == [-0.25, -1.5]
    assert first.top_logprobs[0].token == first.token  # the chosen one keeps its text
    legacy = completion_logprobs(entries, text_offset=4)
    assert legacy.text_offset[0] == 4
    assert legacy.text_offset[1] == 4 + len(entries[0].text)
    assert list(legacy.top_logprobs[0].values()) == [-0.25, -1.5]
