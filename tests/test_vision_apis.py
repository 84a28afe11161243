"""Images through every API of a real server with a real (tiny, random, converted) Qwen3.5
vision-language model, driven by the official clients.

Each answer equals transformers' greedy tokens for the prompt its own tokenizer and chat
template render from the same conversation, with the same picture: OpenAI chat, Responses
and Anthropic Messages, streamed and not; Claude Code's Read of a picture (a `tool_result`
holding an image, sent inline or as a URL the server fetches from an allowed local host);
a chat image URL fetched through a redirect within its host; the next turn resending its
screenshot as a prefix-cache hit over the image's blocks, and another picture of the same
size hitting none of them; bad images refused with a 400 naming the field while the server
goes on serving.

The tokenizer reads text one character a token (a BPE vocabulary of single characters, no
merges: the model family's own tokenizer class keeps it), so prompts hold text as well as
images.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from image_files import data_url, encoded, png_claiming
from image_files import picture as url_picture
from image_server import serving_images
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import running_app
from tiny_models import VOCAB, build_tiny_model
from tiny_vision import IMAGE, image_processor, image_token_count, picture, transformers_greedy
from tokenizers import AddedToken, Tokenizer, models
from transformers import AutoTokenizer

from convert import convert_model
from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from server.app import build_app
from server.async_engine import AsyncEngine
from server.cli import main
from server.media.options import MediaOptions

SPECIAL = {IMAGE: "<|image_pad|>", IMAGE + 1: "<|video_pad|>", IMAGE + 2: "<|vision_start|>",
           IMAGE + 3: "<|vision_end|>"}
# Roles and content as written; an image as Qwen's templates write it; tools by name (the
# word "tools" makes the server hand them, and tool calls and results, to the template).
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
    "{% elif m.content %}{% for p in m.content %}{% if p.type == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}{% for c in m.tool_calls or [] %}<call {{ c.function.name }}>{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
MAX_TOKENS = 6
BLOCK = 8
QUESTION = "What is in this picture?"
MAX_IMAGES = 2
# The anthropic client has no `temperature` argument any more; the API still reads it.
GREEDY = {"temperature": 0}


def save_char_tokenizer(path) -> None:
    """One token per character (byte-level: a space is "Ġ", a newline "Ċ"); the ids left
    over decode to letter pairs; the vision tokens at the config's ids."""
    chars = ["\u0120", "\u010a"] + [chr(b) for b in range(33, 127)]
    pairs = [a + b for a in "etaoinshrdlu" for b in "etaoinshrdlu"]
    words = iter(chars + pairs)
    vocab = {next(words): i for i in range(VOCAB) if i not in SPECIAL}
    vocab.update({name: i for i, name in SPECIAL.items()})
    tokenizer = Tokenizer(models.BPE(vocab, merges=[]))
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in SPECIAL.values()])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


class Served:
    """The server's URL, and transformers' side of the same checkpoint."""

    def __init__(self, url: str, images: str, model_dir, model, processor, tokenizer) -> None:
        self.url = url
        self.images = images  # the image server's base URL (its host allowed)
        self.model_dir = model_dir
        self.model = model
        self.processor = processor
        self.tokenizer = tokenizer

    def prompt_ids(self, conversation: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def answer(self, conversation: list[dict], image, tools: list[dict] | None = None) -> str:
        """transformers' greedy answer to the conversation (one image) as text."""
        ids = self.prompt_ids(conversation, tools)
        tokens = transformers_greedy(self.model, self.processor, ids, image, MAX_TOKENS)
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def prompt_tokens(self, conversation: list[dict], image,
                      tools: list[dict] | None = None) -> int:
        """The prompt's length once its image placeholder is expanded."""
        ids = self.prompt_ids(conversation, tools)
        return len(ids) - 1 + image_token_count(self.processor, image)

    def image_blocks(self, conversation: list[dict], image) -> tuple[int, int]:
        """(tokens in the blocks wholly before the image, tokens in the blocks up to its
        end): what another picture may share, and what the same one must."""
        ids = self.prompt_ids(conversation)
        start = ids.index(IMAGE)
        end = start + image_token_count(self.processor, image)
        return start // BLOCK * BLOCK, end // BLOCK * BLOCK

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    source = tmp_path_factory.mktemp("qwen3_5-hf")
    model = build_tiny_model("qwen3_5_text", source, vision=True)
    processor = image_processor()
    processor.save_pretrained(source)
    save_char_tokenizer(source)
    model_dir = convert_model(source, tmp_path_factory.mktemp("qwen3_5") / "model",
                              progress=False)
    engine = build_engine(EngineConfig(model_dir=model_dir, max_model_len=256,
                                       kv_cache_memory=16 << 20, block_size=BLOCK))
    bridge = AsyncEngine(engine, media=MediaOptions(
        max_images=MAX_IMAGES, allowed_domains=frozenset({"127.0.0.1"})))
    with serving_images() as images, running_app(build_app(bridge, "default")) as url:
        yield Served(url, images, model_dir, model, processor,
                     AutoTokenizer.from_pretrained(model_dir))


def png_url(image) -> str:
    return data_url(encoded(image, "PNG"))


def base64_source(image) -> dict:
    return {"type": "base64", "media_type": "image/png", "data": png_url(image).split(",")[1]}


# The question every API sends here with its picture, as the chat template gets it.
ASKED = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}]


SHOT = picture(16, 16, 10)  # 16 image tokens


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_answers_about_the_picture_as_transformers(served, stream):
    content = [{"type": "text", "text": QUESTION},
               {"type": "image_url", "image_url": {"url": png_url(SHOT)}}]  # fmt: skip
    reply = served.openai().chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], stream=stream,
        max_tokens=MAX_TOKENS, temperature=0)
    text = ("".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream
            else reply.choices[0].message.content)
    assert text == served.answer(ASKED, SHOT)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_input_image_answers_as_transformers(served, stream):
    content = [{"type": "input_text", "text": QUESTION},
               {"type": "input_image", "image_url": png_url(SHOT)}]  # fmt: skip
    response = served.openai().responses.create(
        model="default", input=[{"role": "user", "content": content}], stream=stream,
        max_output_tokens=MAX_TOKENS, temperature=0)
    if stream:
        text = "".join(e.delta for e in response if e.type == "response.output_text.delta")
    else:
        text = response.output_text
    assert text == served.answer(ASKED, SHOT)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_image_block_answers_as_transformers(served, stream):
    content = [{"type": "text", "text": QUESTION},
               {"type": "image", "source": base64_source(SHOT)}]  # fmt: skip
    client = served.anthropic()
    messages = [{"role": "user", "content": content}]
    if stream:
        with client.messages.stream(model="default", max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                    messages=messages) as events:
            text = "".join(events.text_stream)
    else:
        message = client.messages.create(model="default", max_tokens=MAX_TOKENS,
                                         extra_body=GREEDY, messages=messages)
        text = message.content[0].text
    assert text == served.answer(ASKED, SHOT)


READ = {"name": "Read", "description": "Read a file.", "input_schema": {
    "type": "object", "properties": {"file_path": {"type": "string"}}}}  # fmt: skip


def claude_read(source: dict) -> list[dict]:
    """Claude Code's Read of a picture: the request, the tool call, and a `tool_result`
    holding the image from `source`."""
    return [
        {"role": "user", "content": "Read shot.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                           "input": {"file_path": "shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "image", "source": source}]}]},
    ]  # fmt: skip


# `claude_read` as the chat template gets it, and its tools.
READ_TURNS = [
    {"role": "user", "content": "Read shot.png"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "Read", "arguments": {}}}]},
    {"role": "tool", "content": [{"type": "image"}]},
]  # fmt: skip
READ_TOOLS = [{"type": "function", "function": {"name": "Read"}}]


def test_claude_codes_read_of_a_picture_reaches_the_model(served):
    shot = picture(16, 12, 11)
    message = served.anthropic().messages.create(
        model="default", max_tokens=MAX_TOKENS, extra_body=GREEDY, tools=[READ],
        messages=claude_read(base64_source(shot)))
    assert message.content[0].text == served.answer(READ_TURNS, shot, READ_TOOLS)
    usage = message.usage
    prompt = served.prompt_tokens(READ_TURNS, shot, READ_TOOLS)
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt
    assert prompt > image_token_count(served.processor, shot) == 12


def test_an_image_url_in_a_tool_result_is_fetched_and_answered(served):
    """Claude Code's Read as an Anthropic url source: the server fetches the picture from an
    allowed host and answers as transformers does for it."""
    source = {"type": "url", "url": f"{served.images}/picture.png"}
    message = served.anthropic().messages.create(
        model="default", max_tokens=MAX_TOKENS, extra_body=GREEDY, tools=[READ],
        messages=claude_read(source))
    assert message.content[0].text == served.answer(READ_TURNS, url_picture(), READ_TOOLS)


def test_a_chat_image_url_is_fetched_through_a_redirect_within_the_host(served):
    def image_at(path: str) -> list[dict]:
        return [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": served.images + path}}]}]  # fmt: skip

    client = served.openai()
    reply = client.chat.completions.create(model="default", messages=image_at("/moved"),
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == served.answer(ASKED, url_picture())
    with pytest.raises(openai.BadRequestError) as raised:  # never to another host
        client.chat.completions.create(model="default", messages=image_at("/moved-away"),
                                       max_tokens=MAX_TOKENS)
    assert raised.value.body["param"] == "messages[0].content[1].image_url"
    assert "redirects to another host (localhost)" in raised.value.body["message"]


def next_turn(first: list[dict], answer: str) -> list[dict]:
    return [*first, {"role": "assistant", "content": answer},
            {"role": "user", "content": "And in the corner?"}]


def test_the_next_turn_resending_a_screenshot_is_a_cache_hit_over_its_blocks(served):
    client = served.openai()
    shot, other = picture(16, 16, 12), picture(16, 16, 13)

    def ask(image, messages=None):
        messages = messages or [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": png_url(image)}}]}]  # fmt: skip
        reply = client.chat.completions.create(model="default", messages=messages,
                                               max_tokens=MAX_TOKENS, temperature=0)
        return messages, reply

    first, reply = ask(shot)
    before, through = served.image_blocks(ASKED, shot)
    assert through > before + BLOCK  # the image fills whole blocks
    again, resent = ask(shot, next_turn(first, reply.choices[0].message.content))
    assert resent.usage.prompt_tokens_details.cached_tokens >= through
    _, elsewhere = ask(other)
    assert elsewhere.choices[0].message.content == served.answer(ASKED, other)
    assert elsewhere.usage.prompt_tokens_details.cached_tokens <= before


def test_anthropic_reports_the_resent_screenshot_as_cache_reads(served):
    shot = picture(16, 16, 14)
    first = [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                          {"type": "image", "source": base64_source(shot)}]}]
    client = served.anthropic()
    answer = client.messages.create(model="default", max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                    messages=first)
    resent = client.messages.create(model="default", max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                    messages=next_turn(first, answer.content[0].text))
    _, through = served.image_blocks(ASKED, shot)
    assert resent.usage.cache_read_input_tokens >= through
    conversation = next_turn(ASKED, answer.content[0].text)
    assert (resent.usage.input_tokens + resent.usage.cache_read_input_tokens
            == served.prompt_tokens(conversation, shot))


def test_bad_images_are_400s_naming_the_field_and_the_server_goes_on(served):
    client = served.openai()
    too_many = [{"type": "image_url", "image_url": {"url": png_url(SHOT)}}] * (MAX_IMAGES + 1)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="default", max_tokens=MAX_TOKENS,
                                       messages=[{"role": "user", "content": too_many}])
    assert raised.value.body["param"] == f"messages[0].content[{MAX_IMAGES}].image_url"
    assert f"at most {MAX_IMAGES} are read per request" in raised.value.body["message"]

    bomb = {"type": "base64", "media_type": "image/png",
            "data": data_url(png_claiming(6000, 5000)).split(",")[1]}
    with pytest.raises(anthropic.BadRequestError) as raised:
        served.anthropic().messages.create(model="default", max_tokens=MAX_TOKENS, messages=[
            {"role": "user", "content": [{"type": "image", "source": bomb}]}])
    assert raised.value.body["error"]["message"].startswith(
        "messages[0].content[0].source: the image is 6000x5000 pixels")

    bmp = data_url(encoded(SHOT, "BMP"), "image/png")
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="default", max_output_tokens=MAX_TOKENS, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": bmp}]}])
    assert raised.value.body["param"] == "input[0].content[0].image_url"
    assert "send PNG, JPEG, WebP and GIF images" in raised.value.body["message"]

    test_openai_chat_answers_about_the_picture_as_transformers(served, stream=False)


def test_metrics_count_the_images_encoded_and_the_encoders_time(served):
    before = encoder_counters(served.url)
    shots = [picture(12, 12, 20), picture(12, 12, 21)]
    content = [{"type": "image_url", "image_url": {"url": png_url(s)}} for s in shots]
    for _ in range(2):  # the second time both are cached: no more encoding
        served.openai().chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS, temperature=0)
    after = encoder_counters(served.url)
    assert after["images"] - before["images"] == 2
    assert after["seconds"] > before["seconds"]


def test_bench_serve_vision_reports_the_encoders_time_per_image(served, tmp_path):
    out = tmp_path / "result.json"
    argv = (f"bench serve --base-url {served.url} --tokenizer {served.model_dir} "
            "--workload vision --image-size 16x16 --num-prompts 2 --input-len 4 "
            f"--output-len 3 --max-concurrency 1,2 --result-json {out}").split()
    assert main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    for run in runs:  # each run its own pictures: each encoded once
        assert run["metrics"]["completed"] == 2
        assert run["encoder"]["images"] == 2 and run["encoder"]["ms_per_image"] > 0
        for record in run["records"]:
            # The template's one placeholder and its two markers; the server's 16 image tokens.
            assert record["server_input_tokens"] == record["input_tokens"] + 2 + 16
            assert record["server_output_tokens"] == 3


def encoder_counters(url: str) -> dict[str, float]:
    names = {"metal_serve_images_encoded": "images", "metal_serve_encoder_seconds": "seconds"}
    text = httpx.get(f"{url}/metrics").text
    return {names[f.name]: f.samples[0].value
            for f in text_string_to_metric_families(text) if f.name in names}
