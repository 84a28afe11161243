"""A chat request's images, checked against what the model reads, then loaded.

A model without vision reads no image. One in a tool's output becomes a note: an agent
cannot keep its tools (Codex's view_image, Claude Code's Read of a picture) from returning
images, and a 400 would end its session. One anywhere else is a 400 naming its field.
"""

from __future__ import annotations

from server.core.chat_request import ChatCompletionRequest, ChatMessage, ContentPart
from server.http.errors import APIError
from server.media.images import ImageInput, ImageSource
from server.media.load import load_images
from server.media.options import MediaOptions

IMAGE_NOTE = "[image left out: this model reads text only]"


async def chat_images(
    chat: ChatCompletionRequest, vision: bool, options: MediaOptions
) -> tuple[ChatCompletionRequest, list[ImageInput]]:
    """The request as the prompt is built from it, and its images in order (none without
    `vision`: the request's tool-output images are notes then)."""
    if not vision:
        return text_only(chat), []
    sources = [
        ImageSource(field, part.image_url.url, part.image_url.detail)
        for _, part, field in chat.image_parts()
        if part.image_url is not None  # validation saw to it
    ]
    return chat, await load_images(sources, options)


def text_only(chat: ChatCompletionRequest) -> ChatCompletionRequest:
    """`chat` with each tool output's image a note; a 400 for any other image."""
    images = chat.image_parts()
    if not images:
        return chat
    for message, _, field in images:
        if message.role != "tool":
            raise APIError(
                f"{field}: this model reads text only (it has no vision); send the request "
                "without images, or serve a model that reads them.",
                param=field,
            )
    return chat.model_copy(update={"messages": [_noted(m) for m in chat.messages]})


def _noted(message: ChatMessage) -> ChatMessage:
    if not any(part.type == "image_url" for part in message.parts()):
        return message
    parts = [
        ContentPart(type="text", text=IMAGE_NOTE) if part.type == "image_url" else part
        for part in message.parts()
    ]
    return message.model_copy(update={"content": parts})
