"""Images end to end on tiny random Qwen vision-language checkpoints, converted as users do:
the picture preprocessed, encoded by our tower, placed in the prompt and served by the engine
must give transformers' greedy tokens for the same picture (its own processor, tower and
model), with an encoder cache too small for two images too; the same screenshot in the next
request is a prefix-cache hit, encoded once, and after a restart a hit from the disk tier;
the official openai client gets its answer from a real server; the memory plan shows the
encoder cache; several ranks are refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from image_files import data_url, encoded
from PIL import Image
from server_helpers import running_server
from tiny_models import VOCAB, build_tiny_model
from tiny_vision import END, IMAGE, START, image_processor, picture, transformers_greedy
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer

from convert import convert_model
from metal_engine.cache.memory_plan import plan_for
from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from metal_engine.loading.weight_bytes import model_dir_weight_bytes
from metal_engine.vision.encoder_cache import ENCODER_CACHE_BYTES
from metal_engine.vision.image_model import has_vision_tower, load_image_model
from metal_engine.warm_up import warm_up
from scheduler import SamplingParams

NAMES = {IMAGE: "<|image_pad|>", START: "<|vision_start|>", END: "<|vision_end|>"}
TEMPLATE = (
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% else %}{{ p.text }}{% endif %} {% endfor %}{% endif %} {% endfor %}"
)
MAX_TOKENS = 6


class Picture:
    """A decoded picture as the server hands it to the vision side."""

    def __init__(self, image: Image.Image, detail: str = "auto") -> None:
        self.image = image
        self.content_hash = f"{image.size}-{image.tobytes().hex()[:32]}"
        self.detail = detail


def save_tokenizer(path) -> None:
    """Words `w<id>` and the image tokens at their ids, with a template that shows images."""
    vocab = {NAMES.get(i, f"w{i}"): i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in NAMES.values()])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_vl_text"])
def checkpoint(request, tmp_path_factory):
    """(transformers' model, its image processor, our converted dir)."""
    source = tmp_path_factory.mktemp(f"{request.param}-hf")
    model = build_tiny_model(request.param, source, vision=True)
    processor = image_processor()
    processor.save_pretrained(source)
    save_tokenizer(source)
    out = convert_model(source, tmp_path_factory.mktemp(request.param) / "model",
                        progress=False)
    return model, processor, out


def engine_of(model_dir, **options):
    return build_engine(EngineConfig(model_dir=model_dir, max_model_len=256,
                                     kv_cache_memory=16 << 20, block_size=8, **options))


def serve_all(engine, prompts: dict[str, tuple[list[int], object]]) -> dict[str, list[int]]:
    """Each request's greedy tokens, all in one batch."""
    for request_id, (ids, media) in prompts.items():
        engine.add_request(request_id, ids, SamplingParams(max_tokens=MAX_TOKENS,
                                                           temperature=0.0), media=media)
    tokens = {request_id: [] for request_id in prompts}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    return tokens


PROMPT = [5, 9, 17, START, IMAGE, END, 40, 41, 8]
TWO_IMAGES = [7, START, IMAGE, END, 33, 12, START, IMAGE, END, 61, 62]


# The MoE families here only: their vision side is the dense ones' (each case ~15 s).
@pytest.mark.parametrize("checkpoint", ["qwen3_5_text", "qwen3_vl_text", "qwen3_5_moe_text",
                                        "qwen3_vl_moe_text"], indirect=True)
@pytest.mark.parametrize("budget", [16, 256], ids=["chunked", "whole"])
def test_served_tokens_equal_transformers_for_the_same_pictures(checkpoint, budget):
    model, processor, model_dir = checkpoint
    engine = engine_of(model_dir, max_num_batched_tokens=budget)  # 16: chunks cut images
    vision = engine.image_model
    assert vision is not None
    wide, tall = picture(24, 10, 1), picture(9, 20, 2)
    prompts = {
        "wide": vision.place(PROMPT, [Picture(wide)]),
        "two": vision.place(TWO_IMAGES, [Picture(tall), Picture(wide)]),
        "text": ([7, 8, 9, 10], None),
    }
    got = serve_all(engine, prompts)
    assert got["wide"] == transformers_greedy(model, processor, PROMPT, wide, MAX_TOKENS)
    assert got["two"] == transformers_greedy(model, processor, TWO_IMAGES, [tall, wide],
                                             MAX_TOKENS)
    assert engine.runner.encoder.num_encoded == 2  # the wide picture once for both prompts
    assert vision.tower.ops is engine.runner.model.ops  # the text model's backend


def test_images_wait_for_room_in_a_small_encoder_cache(checkpoint):
    """An encoder cache of 12 rows holds the wide picture (12 tokens) or the tall one (10),
    never both: a chunk reaching an image the cache cannot take ends before it and the image
    waits for a later step; the wide picture, evicted for the tall one, is encoded again.
    The tokens are transformers' all the same."""
    model, processor, model_dir = checkpoint
    wide, tall = picture(24, 10, 1), picture(9, 20, 2)
    row_bytes = 64 * mx.float32.size * load_image_model(model_dir, mx.float32).feature_maps
    engine = engine_of(model_dir, max_num_batched_tokens=256,
                       encoder_cache_memory=12 * row_bytes)
    assert engine.scheduler.config.encoder_cache_rows == 12
    vision = engine.image_model
    got = serve_all(engine, {"wide": vision.place(PROMPT, [Picture(wide)]),
                             "two": vision.place(TWO_IMAGES, [Picture(tall), Picture(wide)]),
                             "text": ([7, 8, 9, 10], None)})
    assert got["wide"] == transformers_greedy(model, processor, PROMPT, wide, MAX_TOKENS)
    assert got["two"] == transformers_greedy(model, processor, TWO_IMAGES, [tall, wide],
                                             MAX_TOKENS)
    assert engine.runner.encoder.num_encoded == 3


def test_the_memory_plan_shows_the_encoder_cache_on_its_own_line(checkpoint, tmp_path, capsys):
    from server.cli import main

    _, _, model_dir = checkpoint
    model, weights = model_dir_weight_bytes(model_dir, mx.float32)
    lines = plan_for(EngineConfig(model_dir, encoder_cache_memory=64 << 20), model,
                     weights).describe()
    assert "encoder cache: 64.0 MiB" in "\n".join(lines)
    assert plan_for(EngineConfig(model_dir), model, weights).encoder_cache == ENCODER_CACHE_BYTES
    assert main(["serve", str(model_dir), "--dry-run", "--encoder-cache-memory", "32MiB"]) == 0
    assert "encoder cache: 32.0 MiB" in capsys.readouterr().out
    text_only = convert_model(model_dir, tmp_path / "text", progress=False, text_only=True)
    assert not has_vision_tower(text_only)
    assert plan_for(EngineConfig(text_only), model, weights).encoder_cache == 0


@pytest.mark.parametrize("flag", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_images_over_several_ranks_are_refused_at_start_naming_the_flag(checkpoint, flag):
    _, _, model_dir = checkpoint
    option = "--" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=f"{option} 2: .* reads images, .* --text-only"):
        build_engine(EngineConfig(model_dir, **{flag: 2}))


def test_the_same_screenshot_next_turn_is_a_cache_hit_encoded_once(checkpoint):
    model, processor, model_dir = checkpoint
    engine = engine_of(model_dir)
    vision = engine.image_model
    shot, other = picture(16, 16, 3), picture(16, 16, 4)
    first = serve_all(engine, {"first": vision.place(PROMPT, [Picture(shot)])})
    again = serve_all(engine, {"again": vision.place(PROMPT, [Picture(shot)])})
    assert again["again"] == first["first"] == transformers_greedy(model, processor, PROMPT,
                                                                   shot, MAX_TOKENS)
    ids, _ = vision.place(PROMPT, [Picture(shot)])
    assert engine.stats().prefix_cache_hit_tokens >= len(ids) - 8  # all but the last block
    assert engine.runner.encoder.num_encoded == 1
    hits = engine.stats().prefix_cache_hit_tokens
    serve_all(engine, {"other": vision.place(PROMPT, [Picture(other)])})
    # Only the block before the image's first is shared with another picture.
    assert engine.stats().prefix_cache_hit_tokens - hits <= ids.index(IMAGE)


def test_the_openai_client_sends_a_screenshot_to_a_real_server(checkpoint):
    model, processor, model_dir = checkpoint
    shot = picture(20, 12, 5)
    url = data_url(encoded(shot, "PNG"))
    # transformers loads the family's own tokenizer class over the test's word vocabulary,
    # which reads only its special tokens: the prompt is the image alone.
    content = [{"type": "image_url", "image_url": {"url": url}}]
    with running_server(engine_of(model_dir)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS, temperature=0)
        again = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS, temperature=0)
        cards = client.models.list().data
    assert {tuple(card.model_extra["capabilities"]) for card in cards} == {
        ("completion", "chat", "vision")}
    want = transformers_greedy(model, processor, [START, IMAGE, END], shot, MAX_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert answer.choices[0].message.content == tokenizer.decode(want)
    assert again.choices[0].message.content == answer.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_warm_up_runs_the_tower_before_the_first_image_request(checkpoint):
    model, processor, model_dir = checkpoint
    engine = engine_of(model_dir)
    warm_up(engine)
    assert engine.runner.encoder.num_encoded == 1  # the warm-up's picture
    shot = picture(14, 18, 6)
    got = serve_all(engine, {"after": engine.image_model.place(PROMPT, [Picture(shot)])})
    assert got["after"] == transformers_greedy(model, processor, PROMPT, shot, MAX_TOKENS)
    assert not engine.scheduler.requests  # the warm-up's request is not the engine's


# Text after the image, so that the blocks holding it are all before the prompt's last block.
LONG_PROMPT = [*PROMPT, 30, 31, 32, 33, 34, 35, 36, 37, 38]


def test_a_restarted_engine_reads_the_screenshots_blocks_from_disk(checkpoint, tmp_path):
    """The disk tier keys an image's blocks by its content as memory does: after a restart
    the same picture's blocks are stored hits (its encoding skipped), tokens as
    transformers'; another picture of the same size shares none of them."""
    model, processor, model_dir = checkpoint
    shot, other = picture(16, 16, 7), picture(16, 16, 8)
    first = engine_of(model_dir, kv_cache_dir=tmp_path)
    want = transformers_greedy(model, processor, LONG_PROMPT, shot, MAX_TOKENS)
    placed = first.image_model.place(LONG_PROMPT, [Picture(shot)])
    assert serve_all(first, {"first": placed})["first"] == want
    first.close()

    restarted = engine_of(model_dir, kv_cache_dir=tmp_path)
    vision, stats = restarted.image_model, restarted.scheduler.prefix_cache.stats
    got = serve_all(restarted, {"other": vision.place(LONG_PROMPT, [Picture(other)])})
    assert got["other"] == transformers_greedy(model, processor, LONG_PROMPT, other, MAX_TOKENS)
    ids, media = vision.place(LONG_PROMPT, [Picture(shot)])
    assert stats.stored_hit_tokens <= ids.index(IMAGE)
    assert restarted.runner.encoder.num_encoded == 1

    assert serve_all(restarted, {"again": (ids, media)})["again"] == want
    [image] = media.images
    assert stats.stored_hit_tokens >= -(-image.end // 8) * 8  # every block holding the image
    assert restarted.runner.encoder.num_encoded == 1  # not encoded again


# Serving installs no PyTorch: a picture decoded, placed, encoded and served without it.
WITHOUT_TORCH = """
import asyncio, json, sys
sys.modules["torch"] = None  # any import of torch fails
from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from scheduler import SamplingParams
from server.media.images import ImageSource
from server.media.load import load_images
from server.media.options import MediaOptions

model_dir, url, prompt, max_tokens = json.loads(sys.argv[1])
engine = build_engine(EngineConfig(model_dir=model_dir, max_model_len=256,
                                   kv_cache_memory=16 << 20, block_size=8))
images = asyncio.run(load_images([ImageSource("image_url", url)], MediaOptions()))
ids, media = engine.image_model.place(prompt, images)
engine.add_request("a", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   media=media)
tokens = []
while engine.has_unfinished_requests():
    tokens += [t for out in engine.step() for t in out.new_token_ids]
print(json.dumps(tokens))
"""


def test_an_image_is_served_without_pytorch(checkpoint):
    model, processor, model_dir = checkpoint
    shot = picture(18, 14, 9)
    url = data_url(encoded(shot, "PNG"))
    argument = json.dumps([str(model_dir), url, PROMPT, MAX_TOKENS])
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, argument], check=True,
                          capture_output=True, text=True, cwd=Path(__file__).parents[1])
    tokens = json.loads(done.stdout.splitlines()[-1])
    assert tokens == transformers_greedy(model, processor, PROMPT, shot, MAX_TOKENS)
