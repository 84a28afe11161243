"""Incremental detokenization: whole characters only, stop strings never emitted."""

from __future__ import annotations

from metal_engine.detokenizer import IncrementalDetokenizer


def stream(tokenizer, text: str, stop=(), prompt="Say:") -> tuple[list[str], str | None]:
    """The deltas, and the stop string that ended the text (None if none did)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), tuple(stop))
    deltas = []
    for i, token in enumerate(ids):
        stopped = detok.add_token(token)
        deltas.append(detok.take_delta(final=stopped is not None or i == len(ids) - 1))
        if stopped is not None:
            return deltas, stopped
    return deltas, None


def test_deltas_join_to_the_text_and_never_split_a_character(default_tokenizer):
    text = "Paris — café, naïve 日本語 🙂 done."
    deltas, _ = stream(default_tokenizer, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # Multi-byte characters span several byte-level tokens: some steps must have waited.
    assert "" in deltas


def test_stop_string_spanning_tokens_is_cut_and_never_emitted(default_tokenizer):
    deltas, stopped = stream(default_tokenizer, "one two three STOP_HERE four", stop=["STOP_HERE"])
    assert stopped == "STOP_HERE"
    assert "".join(deltas) == "one two three "
    assert all("STOP" not in d for d in deltas)


def test_earliest_of_several_stop_strings_wins(default_tokenizer):
    deltas, stopped = stream(default_tokenizer, "alpha beta gamma", stop=["gamma", "beta"])
    assert stopped == "beta" and "".join(deltas) == "alpha "
