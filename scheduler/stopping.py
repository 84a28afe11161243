"""Why a request stops: the one place that decides, token by token, in step order.

At one new output token, the first of these that holds ends the request:

    its grammar failed on the token                       "error"   (the output check's)
    the token is an EOS (unless ignored) or a stop token  "stop"
    the text now holds one of its stop strings            "stop"    (the string matched)
    the token completes its grammar                       "stop"
    max_tokens is reached, or the context is full         "length"

A pooling request has no output tokens: it ends "stop" in the step that pools its prompt
(`POOLED`).

The first token that ends a request ends it: the outputs after it (drafts accepted in the same
step) are dropped. Outside any step, `Scheduler.finish_request` ends a request as "abort" (its
client left, the server shuts down).

The text and the grammar belong to the engine (its detokenizer, its matchers): it hands the
scheduler each request's `OutputCheck`, which the judge feeds every new token in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from scheduler.request import FinishReason, Request


@dataclass(frozen=True)
class Stop:
    """Why a request ended, with the stop string that ended it, or what failed ("error")."""

    reason: FinishReason
    stop_string: str | None = None
    error: str | None = None


POOLED = Stop("stop")


class OutputCheck(Protocol):
    """A request's checks on its output beyond token ids: its stop strings (on the decoded
    text) and its grammar."""

    def check(self, token_id: int) -> Stop | None:
        """Take the request's next output token; the stop it makes: "error" (the grammar
        failed on it), a stop string matched, the grammar complete; None while it goes on."""


def judge(request: Request, index: int, tokens: list[int], max_model_len: int,
          check: OutputCheck | None = None) -> tuple[int, Stop | None]:
    """Of the request's new outputs `tokens` (its outputs `index ..`), how many it keeps and
    why it stops after the last one kept (None: it goes on)."""
    for offset, token_id in enumerate(tokens):
        by_output = check.check(token_id) if check is not None else None
        stop = _stop_at(request, token_id, index + offset + 1, max_model_len, by_output)
        if stop is not None:
            return offset + 1, stop
    return len(tokens), None


def _stop_at(request: Request, token_id: int, num_outputs: int, max_model_len: int,
             by_output: Stop | None) -> Stop | None:
    if by_output is not None and by_output.reason == "error":
        return by_output
    params = request.params
    if (token_id in params.stop_token_ids
            or (not params.ignore_eos and token_id in request.eos_token_ids)):
        return Stop("stop")
    if by_output is not None:
        return by_output
    if (num_outputs >= params.max_tokens
            or request.num_prompt_tokens + num_outputs >= max_model_len):
        return Stop("length")
    return None
