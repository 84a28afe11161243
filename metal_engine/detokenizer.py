"""Incremental detokenization with stop strings, one instance per request."""

from __future__ import annotations

# Prompt tokens kept as decoding context so the first output token gets its spacing right.
PROMPT_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A delta never ends inside a multi-byte character (the decoder's U+FFFD means "wait for the
    next token") and never contains any part of a stop string: text that could still grow into
    one is held back until it cannot.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # decoded output text so far
        self.emitted = 0  # characters of `text` already handed out

    def add_token(self, token_id: int) -> bool:
        """Decode one more token; True if the text now contains a stop string."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._cut_at_stop()

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out; `final` releases what was held back for stop matching."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold_back)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _cut_at_stop(self) -> bool:
        if not self.stop:
            return False
        search_from = max(0, self.emitted - self.hold_back)
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
