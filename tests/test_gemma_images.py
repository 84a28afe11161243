"""Images end to end on tiny random Gemma 3 and Gemma 4 vision-language checkpoints, converted
as users do. Their text models let an image's tokens see each other in prefill (Gemma 3 on
every layer, Gemma 4 on its sliding ones): the logits of a prompt with images must equal
transformers' (its own tower, its bidirectional mask, a window shorter than an image), the
served greedy tokens must equal transformers' `generate` with its own image processor, with a
token budget that chunks the prompts (never inside an image), and the scheduler must refuse
to cut an image.
"""

from __future__ import annotations

import json
import shutil
from contextlib import nullcontext

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from engine_helpers import make_runner_and_scheduler
from PIL import Image
from scheduler_helpers import resolve_step
from tiny_models import GEMMA_IMAGE_TOKENS, VOCAB, build_tiny_model
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from convert import convert_model
from kernels_metal import attention, emulator
from kernels_metal.paged import PagedAttentionKernels
from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from metal_engine.input_batch import build_step_inputs
from metal_engine.models.step_images import StepImages
from metal_engine.vision.gemma_image_model import load_gemma_image_model
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.media import ImageSpan, PromptMedia

IMAGE, BOI, EOI = (GEMMA_IMAGE_TOKENS[k] for k in ("image_token_id", "boi_token_id",
                                                   "eoi_token_id"))
BREAK = 119  # "\n\n", which Gemma 3 writes around an image
NAMES = {IMAGE: "<image_soft_token>", BOI: "<start_of_image>", EOI: "<end_of_image>",
         BREAK: "\n\n"}
MAX_TOKENS = 5
TOL = 1e-4


class Picture:
    """A decoded picture as the server hands it to the vision side."""

    def __init__(self, image: Image.Image, detail: str = "auto") -> None:
        self.image = image
        self.content_hash = f"{image.size}-{image.tobytes().hex()[:32]}"
        self.detail = detail


def picture(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    return Image.fromarray(pixels)


def save_tokenizer(path) -> None:
    """Words `w<id>` and the image tokens and "\\n\\n" at their ids."""
    vocab = {NAMES.get(i, f"w{i}"): i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_tokens([AddedToken("\n\n", normalized=False)])
    tokenizer.add_special_tokens([AddedToken(NAMES[i], special=True) for i in (IMAGE, BOI, EOI)])
    tokenizer.save(str(path / "tokenizer.json"))


PROCESSORS = {
    "gemma3_text": lambda: transformers.Gemma3ImageProcessorPil(size={"height": 32,
                                                                     "width": 32}),
    "gemma4_text": lambda: transformers.Gemma4ImageProcessorPil(
        patch_size=4, pooling_kernel_size=2, max_soft_tokens=70),
}


@pytest.fixture(scope="module", params=list(PROCESSORS))
def checkpoint(request, tmp_path_factory):
    """(family, transformers' model, its image processor, our converted dir)."""
    source = tmp_path_factory.mktemp(f"{request.param}-hf")
    model = build_tiny_model(request.param, source, vision=True)
    processor = PROCESSORS[request.param]()
    processor.save_pretrained(source)
    save_tokenizer(source)
    out = convert_model(source, tmp_path_factory.mktemp(request.param) / "model",
                        progress=False)
    return request.param, model, processor, out


def placeholder(family: str) -> int:
    """What the chat template writes where an image goes."""
    return BOI if family == "gemma3_text" else IMAGE


def expanded(family: str, ids: list[int], counts: list[int]) -> list[int]:
    """`ids` with each placeholder replaced as transformers' processor writes an image of
    `counts[i]` soft tokens."""
    out, images = [], iter(counts)
    for token in ids:
        if token != placeholder(family):
            out.append(token)
            continue
        image = [BOI, *[IMAGE] * next(images), EOI]
        out += [BREAK, *image, BREAK] if family == "gemma3_text" else image
    return out


def pixel_inputs(family: str, processor, images: list[Image.Image]) -> tuple[dict, list[int]]:
    """transformers' image inputs for `images` and each one's soft-token count."""
    batch = processor(images=images, return_tensors="pt")
    if family == "gemma3_text":
        return {"pixel_values": batch["pixel_values"]}, [16] * len(images)
    return ({"pixel_values": batch["pixel_values"],
             "image_position_ids": batch["image_position_ids"]},
            [int(n) for n in batch["num_soft_tokens_per_image"]])


def type_ids(family: str, ids: torch.Tensor) -> dict:
    is_image = (ids == IMAGE).int()
    return {"token_type_ids" if family == "gemma3_text" else "mm_token_type_ids": is_image}


def transformers_greedy(family, model, processor, ids, images) -> list[int]:
    pixels, counts = pixel_inputs(family, processor, images)
    prompt = torch.tensor([expanded(family, ids, counts)])
    with torch.no_grad():
        out = model.generate(prompt, **pixels, **type_ids(family, prompt),
                             max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def text(first: int, count: int) -> list[int]:
    return [first + i % 100 for i in range(count)]


@pytest.mark.parametrize("budget", [16, 512])
def test_served_tokens_equal_transformers(checkpoint, budget):
    family, model, processor, model_dir = checkpoint
    engine = build_engine(EngineConfig(model_dir=model_dir, max_model_len=256,
                                       kv_cache_memory=16 << 20, block_size=8,
                                       max_num_batched_tokens=budget))
    vision, mark = engine.image_model, placeholder(family)
    wide, tall = picture(40, 24, 1), picture(20, 36, 2)
    # Gemma 4's budget is raised to its largest image (70 tokens): longer text chunks it.
    lead = 6 if family == "gemma3_text" else 60
    prompts = {
        "one": ([*text(5, lead), mark, 40, 41, 8], [wide]),
        "two": ([3, mark, *text(9, lead), mark, 50], [tall, wide]),
    }
    requests = {name: vision.place(ids, [Picture(i) for i in images])
                for name, (ids, images) in prompts.items()}
    for request_id, (ids, media) in {**requests, "text": ([7, 8, 9, 10], None)}.items():
        engine.add_request(request_id, ids, SamplingParams(max_tokens=MAX_TOKENS,
                                                           temperature=0.0), media=media)
    got = {request_id: [] for request_id in [*requests, "text"]}
    while engine.has_unfinished_requests():
        for output in engine.step():
            got[output.request_id] += output.new_token_ids
    for name, (ids, images) in prompts.items():
        placed, _ = requests[name]
        assert placed == expanded(family, ids, pixel_inputs(family, processor, images)[1])
        assert got[name] == transformers_greedy(family, model, processor, ids, images)
    assert engine.runner.encoder.num_encoded == 2


def image_rows(family, model, processor, ids: list[int], images) -> tuple[dict, StepImages]:
    """transformers' inputs for `ids` and the tower's rows as a step of the whole prompt
    carries them."""
    pixels, counts = pixel_inputs(family, processor, images)
    prompt = torch.tensor([expanded(family, ids, counts)])
    with torch.no_grad():
        features = model.model.get_image_features(**pixels, return_dict=True).pooler_output
    embeds = torch.cat(list(features)).reshape(-1, features[0].shape[-1]).numpy()
    rows = np.flatnonzero(prompt[0].numpy() == IMAGE).astype(np.int32)
    return ({"input_ids": prompt, **pixels, **type_ids(family, prompt)},
            StepImages(mx.array(rows), mx.array(embeds)))


def image_ends(ids: np.ndarray) -> np.ndarray:
    """Each position's last visible key: the end of its run of image tokens, else itself."""
    last = np.arange(len(ids))
    for i in range(len(ids) - 2, -1, -1):
        if ids[i] == IMAGE and ids[i + 1] == IMAGE:
            last[i] = last[i + 1]
    return last


class LastKeysCount(PagedAttentionKernels):
    """The emulated kernels, counting the layer kinds whose step reads last keys."""

    calls = 0

    def prepare(self, q, k_pool, meta, *args, **kwargs):
        plan = self.plan(meta, q.shape[1], k_pool.shape[2], *args[2:3])
        self.calls += plan.prefill is not None and plan.prefill.last_keys is not None
        return super().prepare(q, k_pool, meta, *args, **kwargs)


@pytest.mark.parametrize("backend", ["host", "reference", "kernels"])
def test_prompt_logits_with_images_match_transformers(checkpoint, backend):
    """Every row's logits, the image rows seeing their whole image (within the window on
    sliding layers); without that extension they differ. "kernels": the Metal backend, its
    kernels run by the MSL emulator (the prefill kernel's last-keys variant)."""
    family, model, processor, model_dir = checkpoint
    mark = placeholder(family)
    inputs, images = image_rows(family, model, processor, [4, 5, mark, 9, mark, 11, 12],
                                [picture(40, 24, 3), picture(24, 24, 4)])
    with torch.no_grad():
        expected = model(**inputs).logits[0].numpy()
    ids = inputs["input_ids"][0].tolist()
    got = {}
    kernels = LastKeysCount(emulator.metal_kernel)
    for extended in (True, False):
        runner, scheduler = make_runner_and_scheduler(model_dir, block_size=8)
        runner.model.use_ops("metal" if backend == "kernels" else backend)
        scheduler.add_request(Request("a", ids, SamplingParams(max_tokens=1)))
        step = build_step_inputs(scheduler.schedule(), runner.cache.block_size)
        meta = step.attention.with_last_keys(image_ends(np.array(ids)) if extended else None)
        with attention.use_kernels(kernels) if backend == "kernels" else nullcontext():
            hidden = runner.model(mx.array(step.input_ids), mx.array(step.positions), meta,
                                  runner.cache, images)
            got[extended] = np.array(runner.model.logits(hidden))
    np.testing.assert_allclose(got[True], expected, atol=TOL, rtol=TOL)
    assert np.abs(got[False] - expected).max() > 100 * TOL
    assert (kernels.calls > 0) == (backend == "kernels")


def test_detail_takes_gemma4s_smallest_budget_and_leaves_gemma3s_one_size(checkpoint, tmp_path):
    family, _, _, model_dir = checkpoint
    shutil.copytree(model_dir, tmp_path / "model")
    path = tmp_path / "model" / "preprocessor_config.json"
    if family == "gemma4_text":
        path.write_text(json.dumps({**json.loads(path.read_text()), "max_soft_tokens": 280}))
    vision = load_gemma_image_model(tmp_path / "model", mx.float32)
    big = picture(200, 120, 5)
    low, auto, high = (vision.place([vision.placeholder_id], [Picture(big, detail)])[1].images[0]
                       for detail in ("low", "auto", "high"))
    if family == "gemma4_text":
        assert low.length <= 70 < auto.length == high.length <= 280
        assert low.content_hash != auto.content_hash == high.content_hash
        assert vision.max_image_tokens == 280
    else:  # its processor has one image size
        assert low.length == auto.length == high.length == vision.max_image_tokens


def scheduled_chunks(budget: int, images: list[tuple[int, int]], whole: bool,
                     length: int = 40) -> list[tuple[int, int]]:
    """(start, end) of each chunk a 40-token prompt with `images` (offset, length) gets."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=2,
                                          max_num_batched_tokens=budget, max_model_len=128,
                                          encoder_cache_rows=64, whole_images=whole))
    media = PromptMedia(tuple(ImageSpan(offset, count, f"i{offset}", None)
                              for offset, count in images))
    request = Request("a", list(range(1, length + 1)), SamplingParams(max_tokens=1),
                      media=media)
    scheduler.add_request(request)
    chunks = []
    while request.num_computed_tokens < length:
        out = scheduler.schedule()
        (item,) = out.scheduled
        chunks.append((item.start_position, item.start_position + len(item.token_ids)))
        resolve_step(scheduler, out, {"a": 7} if item.samples else {})
    return chunks


def test_the_scheduler_never_cuts_an_image():
    images = [(5, 6), (14, 20)]  # the second longer than the budget
    assert scheduled_chunks(8, images, whole=False) == [(0, 8), (8, 16), (16, 24), (24, 32),
                                                        (32, 40)]
    # Before the first image, then the image whole; before the second, which then goes in
    # one chunk over the budget.
    assert scheduled_chunks(8, images, whole=True) == [(0, 5), (5, 13), (13, 14), (14, 34),
                                                       (34, 40)]
