"""Reasoning models' `<think>...</think>` text (Mistral's `[THINK]...[/THINK]`), split from the
answer as `reasoning_content`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ThinkTags:
    open: str
    close: str


THINK = ThinkTags("<think>", "</think>")
# Magistral's and Mistral Small 4's (special tokens of their tokenizers).
MISTRAL_THINK = ThinkTags("[THINK]", "[/THINK]")


def think_tags(template: str) -> ThinkTags:
    """The tags around the reasoning of a chat template's model: Mistral's where the
    template writes them, else `<think>`."""
    return MISTRAL_THINK if MISTRAL_THINK.open in template else THINK


def opens_reasoning(prompt_text: str, tags: ThinkTags = THINK) -> bool:
    """Whether the prompt already opened the reasoning block (templates that end the
    generation prompt with `<think>`), so the model's text starts inside it."""
    return prompt_text.rstrip().endswith(tags.open)


def _partial_marker_start(text: str, start: int, marker: str) -> int:
    """Where a suffix of `text[start:]` that could still grow into `marker` begins."""
    for i in range(max(start, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[i:]):
            return i
    return len(text)


class ReasoningStream:
    """Splits one choice's text, delta by delta, into reasoning and content.

    Reasoning is what a leading `<think>` block (`tags`) holds; a text that does not start
    with one is all content. Partial markers are held back until they resolve.
    """

    def __init__(self, starts_inside: bool = False, tags: ThinkTags = THINK) -> None:
        self.tags = tags
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
            close_tag = self.tags.close
            close = self.text.find(close_tag, self.pos)
            if close < 0:
                end = (
                    len(self.text)
                    if final
                    else _partial_marker_start(self.text, self.pos, close_tag)
                )
                reasoning, self.pos = self.text[self.pos : end], end
                return reasoning, ""
            reasoning = self.text[self.pos : close]
            self.pos = close + len(close_tag)
            self.state = "content"
        content, self.pos = self.text[self.pos :], len(self.text)
        return reasoning, content

    def _resolve_start(self, final: bool) -> bool:
        """Decide whether the text opens with `<think>`; False while it cannot tell yet."""
        body, open_tag = self.text.lstrip(), self.tags.open
        if body.startswith(open_tag):
            self.state = "reasoning"
            self.pos = len(self.text) - len(body) + len(open_tag)
            return True
        if open_tag.startswith(body) and not final:
            return False
        self.state = "content"
        return True
