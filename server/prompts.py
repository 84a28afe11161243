"""Turn request messages / prompts into token ids, and check them against the context."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jinja2 import TemplateError

from server.errors import APIError
from server.protocol import ChatMessage

# The chat templates of most models know only these roles; "developer" is OpenAI's new
# name for the system prompt.
_ROLE_ALIASES = {"developer": "system"}


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """Render the model's chat template (with the assistant turn opened) and tokenize it."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            "This model has no chat template; use /v1/completions with a plain prompt.",
            param="messages",
        )
    conversation = [
        {"role": _ROLE_ALIASES.get(m.role, m.role), "content": m.text()} for m in messages
    ]
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
    except (TemplateError, ValueError) as exc:  # e.g. roles in an order the model rejects
        message = f"The chat template rejected the messages: {exc}"
        raise APIError(message, param="messages") from exc
    # The template already holds the special tokens (BOS, turn markers).
    return list(tokenizer.encode(text, add_special_tokens=False))


def completion_prompt_ids(tokenizer: Any, prompt: str | list[str] | list[int]) -> list[int]:
    """Token ids of a completion prompt: a string, a one-string list, or token ids."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt[0], str):
        return list(tokenizer.encode(prompt[0]))
    check_token_ids(tokenizer, prompt, "prompt")
    return [int(t) for t in prompt]


def check_token_ids(tokenizer: Any, token_ids: Iterable[int], param: str) -> None:
    vocab_size = len(tokenizer)
    bad = [t for t in token_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise APIError(f"Token ids must be in [0, {vocab_size}); got {bad[:5]}.", param=param)


def check_context(num_prompt: int, max_tokens: int | None, max_model_len: int, param: str) -> int:
    """Return the max_tokens to use, or raise a 400 saying which limit is exceeded."""
    if num_prompt >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt} tokens; shorten the {param}.",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens, but "
            f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt, "
            f"{max_tokens} for the completion); lower max_tokens or shorten the {param}.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens
