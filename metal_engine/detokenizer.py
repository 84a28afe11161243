"""Incremental detokenization with stop strings, one instance per request."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

# Prompt tokens kept as decoding context so the first output token gets its spacing right.
PROMPT_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A delta never ends inside a multi-byte character (the stream decoder yields nothing until
    the character is complete) and never contains any part of a stop string: text that could
    still grow into one is held back until it cannot.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 shown_special_ids: tuple[int, ...] = ()):
        # The Rust tokenizer's stream decoder: one native call per token, no Python re-decoding.
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=True
        )
        # The special tokens written as their text, which the stream decoder skips.
        self._shown = {i: self._backend.id_to_token(i) for i in shown_special_ids}
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # decoded output text so far
        self.emitted = 0  # characters of `text` already handed out

    def add_token(self, token_id: int) -> str | None:
        """Decode one more token; the stop string the text now contains, if one (the text is
        cut before it)."""
        chunk = self._stream.step(self._backend, token_id)
        if chunk:  # None while a multi-byte character is still incomplete
            self.text += chunk
        elif token_id in self._shown:
            self.text += self._shown[token_id]
        return self._cut_at_stop()

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out; `final` releases what was held back for stop matching."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold_back)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _cut_at_stop(self) -> str | None:
        if not self.stop:
            return None
        search_from = max(0, self.emitted - self.hold_back)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return None
        start, matched = min(hits, key=lambda hit: (hit[0], len(hit[1])))
        self.text = self.text[:start]
        return matched
