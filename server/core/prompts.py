"""Turn chat conversations / prompts into token ids, and check them against the context."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from jinja2 import TemplateError

from server.http.errors import APIError


class ChatPrompt(NamedTuple):
    text: str
    ids: list[int]


def chat_template(tokenizer: Any) -> str:
    """The model's chat template text; a 400 if it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise APIError(
            "This model has no chat template; use /v1/completions with a plain prompt.",
            param="messages",
        )
    return str(template)


def chat_prompt(
    tokenizer: Any, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> ChatPrompt:
    """Render the model's chat template (with the assistant turn opened) and tokenize it."""
    # Tools come only for templates with tool syntax (ToolPlan.template_tools).
    extra = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False, **extra
        )
    except (TemplateError, ValueError, TypeError) as exc:
        # e.g. roles in an order the model rejects, or a field the template cannot handle
        message = f"The chat template rejected the messages: {exc}"
        raise APIError(message, param="messages") from exc
    # The template already holds the special tokens (BOS, turn markers).
    _check_unicode(text, "messages")
    return ChatPrompt(text, list(tokenizer.encode(text, add_special_tokens=False)))


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """Token ids of one completion prompt: a string, or token ids."""
    if isinstance(prompt, str):
        _check_unicode(prompt, "prompt")
        return list(tokenizer.encode(prompt))
    check_token_ids(tokenizer, prompt, "prompt")
    return [int(t) for t in prompt]


def _check_unicode(text: str, param: str) -> None:
    """A 400 for text that is no Unicode: JSON's `\\ud800` escapes decode to lone surrogates,
    which the tokenizer refuses with an error that names nothing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise APIError(
            f"{param}: the text holds a lone UTF-16 surrogate (\\u{code:04x}); send valid Unicode.",
            param=param,
        ) from None


def check_token_ids(tokenizer: Any, token_ids: Iterable[int], param: str) -> None:
    vocab_size = len(tokenizer)
    bad = [t for t in token_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise APIError(f"Token ids must be in [0, {vocab_size}); got {bad[:5]}.", param=param)


def check_context(num_prompt: int, max_tokens: int | None, max_model_len: int, param: str) -> int:
    """The max_tokens to generate with: what was asked, capped at what the context has left.

    Agents ask for far more than a local context holds (Claude Code: 128000); as in
    llama-server and Ollama, the turn then ends with the API's length reason where the context
    ends. Only a prompt that leaves no room to generate is a 400.
    """
    if num_prompt >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt} tokens; shorten the {param}.",
            param=param,
            code="context_length_exceeded",
        )
    room = max_model_len - num_prompt
    return room if max_tokens is None else min(max_tokens, room)
