"""What the engine hands back after each step, per request with news."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import FinishReason


@dataclass
class RequestOutput:
    """The delta of one request produced by one engine step.

    `new_text` is the newly decoded text (never a partial multi-byte character, never part of
    a stop string); `finish_reason` is set on the last output of a request.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
