"""Images through the three APIs, driven by the official clients: kept in their place in the
conversation up to the chat template for a model with vision (a scripted one, whose vision
side records the images it is handed; tests/test_vision_serving.py serves a real one), refused with
each API's 400 naming the field for a bad image, decoded off the event loop (a slow one holds
up no other request), and for the text-only default model refused in user messages but a
note in tool outputs (an agent's session goes on)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from fake_engine import ScriptedEngine, ToolTemplateTokenizer
from image_files import data_url, encoded, picture
from server_helpers import running_app, running_server, small_engine

from scheduler.media import PromptMedia
from server.app import build_app
from server.async_engine import AsyncEngine
from server.core.chat_format import prepared_chat
from server.core.chat_images import IMAGE_NOTE
from server.core.chat_request import ChatCompletionRequest
from server.media import load
from server.media.options import MediaOptions

PNG = data_url(encoded(picture(), "PNG"))
WEBP = data_url(encoded(picture((8, 8)), "WEBP"), "image/webp")
BMP = data_url(encoded(picture(), "BMP"), "image/png")
CALL = {"type": "function_call", "call_id": "call_1", "name": "view_image",
        "arguments": '{"path": "plot.png"}'}  # fmt: skip


def codex_output(image_url: str) -> dict:
    """Codex's view_image answer: a text part, then the image."""
    return {"type": "function_call_output", "call_id": "call_1", "output": [
        {"type": "input_text", "text": "plot.png:"},
        {"type": "input_image", "image_url": image_url},
    ]}  # fmt: skip


def claude_tool_result(source: dict) -> dict:
    """Claude Code's Read of a picture: a tool_result holding an image block."""
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                         "content": [{"type": "image", "source": source}]}]}


TOOL_USE = {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}
]}  # fmt: skip
BASE64_PNG = {"type": "base64", "media_type": "image/png", "data": PNG.split(",", 1)[1]}


class ImageRecorder:
    """A vision side that leaves the prompt as the template wrote it and records the images
    each prompt was given, in order."""

    def __init__(self) -> None:
        self.images: list[list] = []

    def place(self, token_ids, images):
        self.images.append(list(images))
        return list(token_ids), PromptMedia(())


class VisionEngine(ScriptedEngine):
    """A scripted engine of a model that reads images."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.image_model = ImageRecorder()
        self.media: dict[str, PromptMedia] = {}

    def add_request(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None,
                    media=None):
        self.media[request_id] = media
        super().add_request(request_id, prompt_token_ids, params, priority, cache_salt)


def turns_of(engine: ScriptedEngine) -> list[dict]:
    """The messages of the latest prompt as the chat template got them (one JSON a line)."""
    _, *turns, _ = list(engine.prompts.values())[-1].split("\n")
    return [json.loads(turn) for turn in turns]


@pytest.fixture(scope="module")
def vision():
    """(engine, base URL) of a scripted model that reads images, at most 3 a request."""
    engine = VisionEngine(["I see."], ToolTemplateTokenizer())
    bridge = AsyncEngine(engine, media=MediaOptions(max_images=3))
    with running_app(build_app(bridge, "m")) as url:
        yield engine, url


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)


def test_chat_images_keep_their_place_up_to_the_template(vision):
    engine, url = vision
    content = [{"type": "text", "text": "Compare"},
               {"type": "image_url", "image_url": {"url": PNG, "detail": "low"}},
               {"type": "text", "text": "with"},
               {"type": "image_url", "image_url": WEBP}]  # fmt: skip
    reply = openai_client(url).chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}])
    assert reply.choices[0].message.content == "I see."
    assert [image.detail for image in engine.image_model.images[-1]] == ["low", "auto"]
    assert list(engine.media.values())[-1] is not None  # the placed images reach the engine
    assert turns_of(engine)[-1]["content"] == [
        {"type": "text", "text": "Compare"}, {"type": "image"},
        {"type": "text", "text": "with"}, {"type": "image"},
    ]  # fmt: skip


def test_anthropic_images_in_user_turns_and_tool_results(vision):
    engine, url = vision
    question = {"role": "user", "content": [
        {"type": "text", "text": "Read it."}, {"type": "image", "source": BASE64_PNG},
    ]}  # fmt: skip
    message = anthropic_client(url).messages.create(
        model="m", max_tokens=8, messages=[question, TOOL_USE, claude_tool_result(BASE64_PNG)])
    assert message.content[0].text == "I see."
    user, _, tool = turns_of(engine)
    assert user["content"] == [{"type": "text", "text": "Read it."}, {"type": "image"}]
    assert (tool["role"], tool["content"]) == ("tool", [{"type": "image"}])


def test_a_codex_tool_output_image_reaches_the_template(vision):
    engine, url = vision
    response = openai_client(url).responses.create(
        model="m", input=[{"role": "user", "content": "Look at plot.png"}, CALL,
                          codex_output(PNG)])  # fmt: skip
    assert response.output_text == "I see."
    assert turns_of(engine)[-1]["content"] == [
        {"type": "text", "text": "plot.png:"}, {"type": "image"}
    ]


def test_bad_images_get_each_apis_400_naming_the_field(vision):
    _, url = vision
    too_many = [{"type": "image_url", "image_url": PNG}] * 4
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client(url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": too_many}])
    assert raised.value.body["param"] == "messages[0].content[3].image_url"
    assert "holds 4 images; at most 3" in raised.value.body["message"]

    bad_base64 = {"type": "base64", "media_type": "image/png", "data": "not base64!"}
    with pytest.raises(anthropic.BadRequestError) as raised:
        anthropic_client(url).messages.create(
            model="m", max_tokens=8, messages=[TOOL_USE, claude_tool_result(bad_base64)])
    assert raised.value.body["error"]["message"].startswith(
        "messages[1].content[0].content[0].source: the image data is not valid base64")

    with pytest.raises(openai.BadRequestError) as raised:
        openai_client(url).responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/cat.png"}]}])
    assert raised.value.body["param"] == "input[0].content[0].image_url"
    assert "--allowed-media-domains example.com" in raised.value.body["message"]

    with pytest.raises(openai.BadRequestError) as raised:
        openai_client(url).responses.create(
            model="m", input=[{"role": "user", "content": "Look"}, CALL, codex_output(BMP)])
    assert raised.value.body["param"] == "input[2].output[1].image_url"
    assert "send PNG, JPEG, WebP and GIF images" in raised.value.body["message"]


DECODE_S = 1.0  # how long the patched decode takes


def test_a_slow_decode_holds_up_no_other_request(vision, monkeypatch):
    """Images are decoded on a worker thread: while one takes a second, /health and a text
    request are answered at once, and the image's request after it."""
    _, url = vision
    decoding = threading.Event()

    def slow_decode(*args):
        decoding.set()
        time.sleep(DECODE_S)
        return decode_image(*args)

    decode_image = load.decode_image
    monkeypatch.setattr(load, "decode_image", slow_decode)
    client = openai_client(url)
    with ThreadPoolExecutor(1) as pool:
        image_reply = pool.submit(client.chat.completions.create, model="m", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": PNG}]}])
        assert decoding.wait(10)
        started = time.monotonic()
        assert httpx.get(f"{url}/health").status_code == 200
        text_reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hello"}])
        elapsed = time.monotonic() - started
        assert not image_reply.done()
        assert image_reply.result().choices[0].message.content == "I see."
    assert text_reply.choices[0].message.content == "I see."
    assert elapsed < DECODE_S / 2


def test_prompt_building_gets_the_decoded_images_in_order():
    engine = VisionEngine(["ok"], ToolTemplateTokenizer())
    bridge = AsyncEngine(engine)
    chat = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": WEBP}]},
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                     {"type": "image_url", "image_url": PNG}]},
    ]})  # fmt: skip
    try:
        prepared = asyncio.run(prepared_chat(bridge, chat, None, None))
    finally:
        bridge.shutdown()
    [images] = engine.image_model.images
    assert [image.field for image in images] == [
        "messages[0].content[0].image_url", "messages[2].content[1].image_url"]
    assert [image.image.size for image in images] == [(8, 8), (24, 16)]
    assert prepared.media is not None


# ---- the text-only default model ------------------------------------------------------------


@pytest.fixture(scope="module")
def text_only(default_model_dir):
    with running_server(small_engine(default_model_dir, 512)) as url:
        yield url


@pytest.mark.slow
def test_a_text_only_model_refuses_user_images_naming_the_field(text_only):
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": PNG}}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client(text_only).chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}], max_tokens=4)
    assert raised.value.body["param"] == "messages[0].content[1].image_url"
    assert "this model reads text only (it has no vision)" in raised.value.body["message"]
    question = {"role": "user", "content": [{"type": "image", "source": BASE64_PNG}]}
    with pytest.raises(anthropic.BadRequestError) as raised:
        anthropic_client(text_only).messages.create(
            model="default", max_tokens=4, messages=[question])
    assert raised.value.body["error"]["message"].startswith(
        "messages[0].content[0].source: this model reads text only")
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client(text_only).responses.create(
            model="default", max_output_tokens=4, input=[{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": PNG}]}])  # fmt: skip
    assert raised.value.body["param"] == "input[0].content[1].image_url"
    assert "this model reads text only (it has no vision)" in raised.value.body["message"]


@pytest.mark.slow
def test_a_text_only_model_reads_tool_output_images_as_notes(text_only):
    response = openai_client(text_only).responses.create(
        model="default", max_output_tokens=4,
        input=[{"role": "user", "content": "Look at plot.png"}, CALL, codex_output(PNG)])
    assert response.status == "incomplete" and response.output_text
    question = {"role": "user", "content": "Read a.png"}
    message = anthropic_client(text_only).messages.create(
        model="default", max_tokens=4, messages=[question, TOOL_USE, claude_tool_result(
            {"type": "url", "url": "https://example.com/a.png"})])  # never fetched
    # Answered (sampled under the model's defaults: within 4 tokens or ending its turn).
    assert message.stop_reason in ("max_tokens", "end_turn") and message.usage.output_tokens
    counted = anthropic_client(text_only).messages.count_tokens(
        model="default", messages=[question, TOOL_USE, claude_tool_result(BASE64_PNG)])
    noted = anthropic_client(text_only).messages.count_tokens(
        model="default", messages=[question, TOOL_USE, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": IMAGE_NOTE}]}])
    assert counted.input_tokens == noted.input_tokens
