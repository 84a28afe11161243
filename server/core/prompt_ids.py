"""Turn chat conversations / prompts into token ids, and check them against the context.

These run on the prompt worker (`AsyncEngine.prepare`), never on the event loop: a megabyte
prompt keeps the tokenizer busy for a second. Text too long to fit the context whatever its
tokens is refused before it is tokenized (`max_text_bytes`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from jinja2 import TemplateError

from server.core.chat_request import ChatCompletionRequest
from server.core.tool_plan import ToolPlan, plan_tools
from server.http.errors import APIError, clip


class ChatPrompt(NamedTuple):
    text: str
    ids: list[int]


def prompt_of(
    tokenizer: Any, chat: ChatCompletionRequest, parser_name: str | None,
    max_text_bytes: int | None = None,
) -> tuple[ChatPrompt, ToolPlan]:
    """The rendered prompt (tools described or passed to the template) and the tool plan."""
    plan = plan_tools(chat, chat_template(tokenizer), parser_name)
    conversation = plan.conversation(chat.messages)
    return chat_prompt(tokenizer, conversation, plan.template_tools(), max_text_bytes), plan


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
    tokenizer: Any, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
    max_text_bytes: int | None = None,
) -> ChatPrompt:
    """Render the model's chat template (with the assistant turn opened) and tokenize it.

    Special tokens come only from the template: one typed into a client's text (content, names,
    tool calls and results, tool descriptions) is encoded as the plain text it is, with
    transformers' `sanitize_control_tokens`, so `<|im_end|>` in a message cannot end its turn.
    """
    # Tools come only for templates with tool syntax (ToolPlan.template_tools).
    extra = {"tools": tools} if tools else {}
    text = _render(tokenizer, conversation, tokenize=False, **extra)
    _check_unicode(text, "messages")
    check_text_fits(text, max_text_bytes, "messages")
    if not _holds_control_tokens(tokenizer, conversation, tools):
        # Nothing to sanitize: the template's text holds only its own special tokens.
        return ChatPrompt(text, list(tokenizer.encode(text, add_special_tokens=False)))
    ids = _render(
        tokenizer, conversation, tokenize=True, sanitize_control_tokens=True, return_dict=False,
        **extra,
    )  # fmt: skip
    return ChatPrompt(text, list(ids))


def _render(tokenizer: Any, conversation: list[dict[str, Any]], **options: Any) -> Any:
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, **options)
    except (TemplateError, ValueError, TypeError) as exc:
        # e.g. roles in an order the model rejects, or a field the template cannot handle
        message = f"The chat template rejected the messages: {exc}"
        raise APIError(message, param="messages") from exc


def special_token_ids(tokenizer: Any, texts: Iterable[str]) -> tuple[int, ...]:
    """The ids of the special tokens (those decoding skips) whose text is one of `texts`."""
    wanted = set(texts)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}  # test doubles have none
    return tuple(i for i, token in added.items() if token.special and token.content in wanted)


def _holds_control_tokens(
    tokenizer: Any, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> bool:
    """Whether a client's string holds a control token's text; a 400 if a dict key does (a
    template writes keys, e.g. a schema's property names, as they are: they cannot be escaped).

    Control tokens here are all added tokens but whitespace ones, a superset of those that
    `sanitize_control_tokens` escapes: when none occurs, it would change nothing.
    """
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}  # test doubles have none
    controls = tuple(t.content for t in added.values() if t.special or not t.content.isspace())
    if not controls:
        return False
    pattern = _pattern_of(controls)
    found = False
    for param, value in (("messages", conversation), ("tools", tools)):
        for text, is_key in _strings(value):
            match = pattern.search(text)
            if match is not None and is_key:
                raise APIError(
                    f"{param}: the key {clip(text)!r} holds {match.group()!r}, a control token "
                    "of this model; rename it.",
                    param=param,
                )
            found = found or match is not None
    return found


@functools.lru_cache(maxsize=8)
def _pattern_of(tokens: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(token) for token in tokens))


def _strings(value: Any) -> Iterator[tuple[str, bool]]:
    """Every string in nested dicts and lists, and whether it is a dict key."""
    if isinstance(value, str):
        yield value, False
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield key, True
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def completion_prompt_ids(
    tokenizer: Any, prompt: str | list[int], max_text_bytes: int | None = None
) -> list[int]:
    """Token ids of one completion prompt: a string, or token ids."""
    if isinstance(prompt, str):
        _check_unicode(prompt, "prompt")
        check_text_fits(prompt, max_text_bytes, "prompt")
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


def completion_prompts_ids(
    tokenizer: Any, prompts: list[str] | list[list[int]], max_text_bytes: int | None = None
) -> list[list[int]]:
    """Token ids of each of a completion request's prompts."""
    return [completion_prompt_ids(tokenizer, prompt, max_text_bytes) for prompt in prompts]


def check_text_fits(text: str, max_text_bytes: int | None, param: str) -> None:
    """A 400, before tokenizing, for text longer than any prompt the context holds."""
    if max_text_bytes is None or len(text) * 4 <= max_text_bytes:  # 4: most bytes a char has
        return
    size = len(text.encode("utf-8"))
    if size > max_text_bytes:
        raise APIError(
            f"The {param} is {size} bytes of text; at most {max_text_bytes} fit in this model's "
            f"context; shorten the {param}.",
            param=param, code="context_length_exceeded",
        )  # fmt: skip


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
