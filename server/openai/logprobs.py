"""Per-token logprobs as the API shows them: token texts that join to the choice's text.

Each sampled token's text is decoded in context, by the same incremental detokenizer the
engine uses, so the texts concatenate to exactly what the engine emitted (a token that only
starts a multi-byte character gets "" and the one completing it gets the character). Tokens
past the emitted text (a stop string, EOS) are dropped, and one straddling the end is cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from metal_engine.detokenizer import IncrementalDetokenizer
from server.openai.protocol import CompletionLogprobs, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from metal_engine.outputs import RequestOutput

# What the API reports for a probability too small to represent (JSON has no -inf).
_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenEntry:
    text: str
    logprob: float
    top: list[tuple[str, float]]  # most likely first


def _logprob(value: float) -> float:
    return max(float(value), _FLOOR)


class LogprobsAligner:
    """Turns one choice's outputs into token entries that line up with its emitted text."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self._decoder = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._pending: list[TokenEntry] = []
        self._emitted = 0  # characters of text the engine has emitted
        self._covered = 0  # characters of it that released entries cover

    def feed(self, output: RequestOutput) -> list[TokenEntry]:
        """Entries whose text the engine has now emitted (all that remain, cut, when it ends)."""
        for token_id, logprobs in zip(output.new_token_ids, output.logprobs or (), strict=True):
            self._decoder.add_token(token_id)
            text = self._decoder.take_delta(final=True)
            top = [(self._top_text(t, token_id, text), _logprob(lp)) for t, lp in logprobs.top]
            top.sort(key=lambda pair: -pair[1])
            self._pending.append(TokenEntry(text, _logprob(logprobs.logprob), top))
        self._emitted += len(output.new_text)
        return self._release(output.finished)

    def _top_text(self, token_id: int, chosen_id: int, chosen_text: str) -> str:
        # The chosen token keeps its in-context text; alternatives are decoded alone.
        return chosen_text if token_id == chosen_id else self.tokenizer.decode([token_id])

    def _release(self, final: bool) -> list[TokenEntry]:
        released, last = 0, len(self._pending) - 1
        for index, entry in enumerate(self._pending):
            room = self._emitted - self._covered
            # At the end a last token of no text (a stop token) is not reported, however many
            # tokens the final output brought (accepted drafts arrive together).
            if len(entry.text) > room or (final and room == 0 and index == last):
                break
            self._covered += len(entry.text)
            released += 1
        ready, self._pending = self._pending[:released], self._pending[released:]
        if final and self._pending and self._emitted > self._covered:
            cut = self._pending[0]
            room = self._emitted - self._covered
            ready.append(TokenEntry(cut.text[:room], cut.logprob, cut.top))
            self._covered = self._emitted
        if final:
            self._pending = []
        return ready


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[TokenEntry]) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token=e.text,
            logprob=e.logprob,
            bytes=_utf8(e.text),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=_utf8(t)) for t, lp in e.top],
        )
        for e in entries
    ]


def _by_text(top: list[tuple[str, float]]) -> dict[str, float]:
    """Alternatives keyed by text; of two tokens with one text the likelier one counts."""
    alternatives: dict[str, float] = {}
    for text, logprob in top:  # most likely first
        alternatives.setdefault(text, logprob)
    return alternatives


def completion_logprobs(entries: list[TokenEntry], text_offset: int) -> CompletionLogprobs:
    """The legacy format; `text_offset` is where the first entry starts in the choice text."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.text)
    return CompletionLogprobs(
        tokens=[e.text for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[_by_text(e.top) for e in entries],
        text_offset=offsets,
    )
