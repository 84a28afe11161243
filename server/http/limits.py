"""Caps on what one request may ask for, checked before it reaches the engine.

Each check raises a 400 naming the field. `check_request_limits` applies every cap to a
request model by the field names the OpenAI and Anthropic APIs use, so a new endpoint calls
it once on its parsed body. (`n` is capped by `--max-n` in serving; `max_tokens` against the
context by `prompts.check_context`.)
"""

from __future__ import annotations

from typing import Any

from server.http.errors import APIError

MAX_STOP_SEQUENCES = 16  # each one is matched against every new piece of text
MAX_TOP_LOGPROBS = 20  # OpenAI's own limit
# Every tool's schema is rendered into the prompt and compiled into the call grammar; agent
# CLIs send tens (Claude Code ~20, Codex ~30 with its namespaces).
MAX_TOOLS = 512
# logit_bias is turned into additions on the engine thread at every step.
MAX_LOGIT_BIAS = 1024


def check_stop_sequences(stop: str | list[str] | None, param: str = "stop") -> None:
    if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
        raise APIError(
            f"{param} has {len(stop)} sequences; at most {MAX_STOP_SEQUENCES} are allowed.",
            param=param,
        )


def check_top_logprobs(value: int | None, param: str = "top_logprobs") -> None:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise APIError(
            f"{param} is {value}; it must be between 0 and {MAX_TOP_LOGPROBS}.", param=param
        )


def check_tool_count(count: int, param: str = "tools") -> None:
    if count > MAX_TOOLS:
        raise APIError(
            f"{param}: {count} tools given; at most {MAX_TOOLS} are supported.", param=param
        )


def check_priority(priority: int, floor: int) -> None:
    """Under `--scheduling-policy priority` a lower value goes first: a client may defer its
    own requests, but only the operator (`--min-request-priority`) lets them jump ahead."""
    if priority < floor:
        raise APIError(
            f"priority is {priority}; this server accepts {floor} or more (lower values go "
            "first, so they are reserved; start the server with a lower "
            "--min-request-priority to allow them).",
            param="priority",
        )


def check_request_limits(body: Any) -> None:
    """Apply every cap to the fields `body` has: `stop` / `stop_sequences` (a list), `tools`,
    `logit_bias`, `top_logprobs`, and the completions API's integer `logprobs`."""
    for param in ("stop", "stop_sequences"):
        check_stop_sequences(getattr(body, param, None), param)
    check_tool_count(len(getattr(body, "tools", None) or ()))
    logit_bias = getattr(body, "logit_bias", None) or {}
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise APIError(
            f"logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed.",
            param="logit_bias",
        )
    check_top_logprobs(getattr(body, "top_logprobs", None))
    logprobs = getattr(body, "logprobs", None)
    if isinstance(logprobs, int) and not isinstance(logprobs, bool):
        check_top_logprobs(logprobs, "logprobs")
