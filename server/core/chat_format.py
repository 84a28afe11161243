"""A chat request as the engine's input and the parser of its answer, in the model's format:
the chat template's (prompt_ids.py, tool_plan.py, reasoning.py, tool_call_stream.py) or, for
a tokenizer that speaks harmony (GPT-OSS), harmony's (harmony_*.py). Every API starts its
assistant turns here, so each format serves all of them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduler.sampling_params import StructuredOutput
from server.core.chat_images import chat_images
from server.core.chat_request import ChatCompletionRequest
from server.core.harmony_encoding import harmony_encoding, speaks_harmony
from server.core.harmony_parsing import HarmonyTurnParser
from server.core.harmony_prompts import harmony_prompt
from server.core.prompt_ids import chat_template, prompt_of, special_token_ids
from server.core.reasoning import ReasoningStream, opens_reasoning, think_tags
from server.core.tool_call_stream import ToolCallStream
from server.core.turn_parsing import TemplateTurnParser, TurnParser
from server.http.errors import APIError
from server.media.images import ImageInput

if TYPE_CHECKING:
    from metal_engine.vision.image_model import ImageModel
    from scheduler import SamplingParams
    from scheduler.media import PromptMedia
    from server.async_engine import AsyncEngine
    from server.sampling_defaults import SamplingDefaults


@dataclass(frozen=True)
class PreparedChat:
    """The prompt's token ids, what the sampler and the detokenizer must add for this format,
    a factory of parsers for the answer (one per choice), and the prompt's images: where each
    one is, `ids` hold as many placeholder tokens as the model's tower gives it embeddings."""

    ids: list[int]
    structured: StructuredOutput | None  # a forced call's or response_format's schema
    stop_token_ids: tuple[int, ...]  # the format's own ends of a turn
    new_parser: Callable[[], TurnParser]
    media: PromptMedia | None = None  # only for a model with vision
    shown_special_ids: tuple[int, ...] = ()  # special tokens of the markup its parsers read

    def sampling_params(
        self, chat: ChatCompletionRequest, max_tokens: int, defaults: SamplingDefaults
    ) -> SamplingParams:
        return self.with_format(chat.sampling_params(max_tokens, self.structured, defaults))

    def with_format(self, params: SamplingParams) -> SamplingParams:
        """`params` with this format's ends of a turn and the special tokens to show."""
        if not (self.stop_token_ids or self.shown_special_ids):
            return params
        stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.stop_token_ids)))
        return dataclasses.replace(params, stop_token_ids=stops,
                                   shown_special_ids=self.shown_special_ids)


def load_chat_format(tokenizer: Any) -> None:
    """Build what the model's format needs before serving (harmony's encoding), so that a
    vocabulary the library refuses stops the server's start, not its first request."""
    if speaks_harmony(tokenizer):
        harmony_encoding(tokenizer)


async def prepared_chat(
    engine: AsyncEngine, chat: ChatCompletionRequest, parser_name: str | None,
    max_text_bytes: int | None,
) -> PreparedChat:
    """`prepare_chat` on the engine's prompt worker, once the request's images are loaded
    (server.core.chat_images): every route that renders a chat request starts here."""
    chat, images = await chat_images(chat, engine.vision, engine.media)
    return await engine.prepare(prepare_chat, engine.tokenizer, chat, parser_name,
                                max_text_bytes, images, engine.image_model)


def prepare_chat(
    tokenizer: Any, chat: ChatCompletionRequest, parser_name: str | None,
    max_text_bytes: int | None = None, images: Sequence[ImageInput] = (),
    image_model: ImageModel | None = None,
) -> PreparedChat:
    """The request in the model's format; a 400 for what that format cannot carry.
    `parser_name` (`--tool-call-parser`) only concerns chat templates; a rendered template
    past `max_text_bytes` is refused before it is tokenized. `images`: the decoded images of
    `chat`'s image parts, in order (a model without vision gets none: `chat_images`), which
    `image_model` (the model's vision side) puts in the prompt."""
    if speaks_harmony(tokenizer):
        return _harmony_chat(tokenizer, chat)
    prompt, plan = prompt_of(tokenizer, chat, parser_name, max_text_bytes)
    tags = think_tags(chat_template(tokenizer))
    starts_inside = opens_reasoning(prompt.text, tags)
    # Mistral's tokenizers hold its markup as special tokens: its parsers must see them.
    markup = (tags.open, tags.close, *(plan.parser.markup() if plan.parser else ()))
    shown = special_token_ids(tokenizer, markup)

    def new_parser() -> TurnParser:
        tools = ToolCallStream(plan.parser) if plan.parser is not None else None
        return TemplateTurnParser(ReasoningStream(starts_inside, tags), tools)

    structured = plan.structured() or chat.response_structure()
    ids, media = prompt.ids, None
    if images:
        try:
            ids, media = image_model.place(prompt.ids, images)
        except ValueError as exc:  # e.g. a template that writes no image placeholder
            raise APIError(f"The images could not be placed in the prompt: {exc}",
                           param="messages") from exc
    return PreparedChat(ids, structured, (), new_parser, media, shown)


async def render_ids(
    engine: AsyncEngine, chat: ChatCompletionRequest, parser_name: str | None
) -> list[int]:
    """The prompt ids a turn of `chat` would be scheduled with, without generating (vLLM's
    render routes), prepared as a generating route does."""
    prepared = await prepared_chat(engine, chat, parser_name, engine.max_prompt_bytes)
    return prepared.ids


def _harmony_chat(tokenizer: Any, chat: ChatCompletionRequest) -> PreparedChat:
    try:
        encoding = harmony_encoding(tokenizer)
    except ValueError as exc:  # the server's model, not the request, is at fault
        raise APIError(str(exc), status_code=500) from exc
    prompt = harmony_prompt(encoding, chat, datetime.date.today().isoformat())
    # <|return|> ends the answer, <|call|> a tool call for the client to run.
    stops = tuple(encoding.stop_tokens_for_assistant_actions())
    # A forced call is opened by the prompt: its arguments are sampled under its schema.
    structured = (None if prompt.forced is None
                  else StructuredOutput(json.dumps(prompt.forced.parameters_schema())))
    return PreparedChat(prompt.ids, structured, stops,
                        lambda: HarmonyTurnParser(encoding, opened=prompt.opened))
