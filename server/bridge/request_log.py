"""The bridge's log lines for each request: queued (with its prompt only when asked) and ended.

Prompts stay out of the logs unless the server runs with --log-prompts: they are the
clients' data.
"""

from __future__ import annotations

from typing import Any

from metal_engine.outputs import RequestOutput
from server.bridge import log


def log_queued(request_id: str, prompt_ids: list[int], tokenizer: Any,
               log_prompts: bool) -> str | None:
    """Log the request; the prompt's text, returned, only with `log_prompts`: otherwise it
    stays out of the logs (and the dashboard)."""
    if not log_prompts:
        log.debug("%s queued with %d prompt tokens", request_id, len(prompt_ids))
        return None
    text = tokenizer.decode(prompt_ids)
    log.info("%s prompt: %r", request_id, text)
    return text


def log_finish(request_id: str, outcome: str, last: RequestOutput | None, seconds: float) -> None:
    if last is None:
        log.info("%s ended (%s) before any output, after %.2fs", request_id, outcome, seconds)
        return
    drafts = ""
    if last.num_draft_tokens:
        drafts = (f", {last.num_accepted_tokens} of {last.num_draft_tokens} draft tokens "
                  "accepted")
    log.info(
        "%s ended (%s): %d prompt tokens (%d cached), %d generated%s, %.2fs", request_id,
        outcome, last.num_prompt_tokens, last.num_cached_tokens, last.num_output_tokens, drafts,
        seconds,
    )  # fmt: skip
