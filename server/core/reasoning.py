"""Reasoning models' `<think>...</think>` text, split from the answer as `reasoning_content`."""

from __future__ import annotations

from typing import Literal

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def opens_reasoning(prompt_text: str) -> bool:
    """Whether the prompt already opened the reasoning block (templates that end the
    generation prompt with `<think>`), so the model's text starts inside it."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def _partial_marker_start(text: str, start: int, marker: str) -> int:
    """Where a suffix of `text[start:]` that could still grow into `marker` begins."""
    for i in range(max(start, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[i:]):
            return i
    return len(text)


class ReasoningStream:
    """Splits one choice's text, delta by delta, into reasoning and content.

    Reasoning is what a leading `<think>` block holds; a text that does not start with one
    is all content. Partial markers are held back until they resolve.
    """

    def __init__(self, starts_inside: bool = False) -> None:
        self.text = ""
        self.pos = 0  # characters of `text` handed out (as either kind, markers skipped)
        self.state: Literal["start", "reasoning", "content"] = (
            "reasoning" if starts_inside else "start"
        )

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """Add a delta; return (new reasoning, new content)."""
        self.text += delta
        if self.state == "start" and not self._resolve_start(final):
            return "", ""
        reasoning = ""
        if self.state == "reasoning":
            close = self.text.find(THINK_CLOSE, self.pos)
            if close < 0:
                end = (
                    len(self.text)
                    if final
                    else _partial_marker_start(self.text, self.pos, THINK_CLOSE)
                )
                reasoning, self.pos = self.text[self.pos : end], end
                return reasoning, ""
            reasoning = self.text[self.pos : close]
            self.pos = close + len(THINK_CLOSE)
            self.state = "content"
        content, self.pos = self.text[self.pos :], len(self.text)
        return reasoning, content

    def _resolve_start(self, final: bool) -> bool:
        """Decide whether the text opens with `<think>`; False while it cannot tell yet."""
        body = self.text.lstrip()
        if body.startswith(THINK_OPEN):
            self.state = "reasoning"
            self.pos = len(self.text) - len(body) + len(THINK_OPEN)
            return True
        if THINK_OPEN.startswith(body) and not final:
            return False
        self.state = "content"
        return True
