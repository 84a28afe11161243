"""A prompt's images in the scheduler and the runner, with no model: block hashes keyed by
image content, the encoder cache's budget, the rows and positions a step gives them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from scheduler_helpers import resolve_step

from metal_engine.models.mrope_positions import MropePositions
from metal_engine.vision.encoder_cache import EncoderCache
from metal_engine.vision.step_media import step_images, step_positions
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.media import ImageSpan, PromptMedia
from scheduler.output import ScheduledRequest

BLOCK = 4
PAD = 99  # the placeholder token: the same id for every image


def image(offset: int, length: int, content_hash: str) -> ImageSpan:
    return ImageSpan(offset, length, content_hash, processed=None)


def prompt_with(content_hash: str) -> tuple[list[int], PromptMedia]:
    """Text, a 6-token image over blocks 1-2, text: 16 tokens."""
    tokens = [1, 2, 3, 4, 5, *[PAD] * 6, 6, 7, 8, 9, 10]
    return tokens, PromptMedia((image(5, 6, content_hash),))


def scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=64, block_size=BLOCK, max_num_seqs=4,
                                     max_num_batched_tokens=64, max_model_len=128,
                                     enable_prefix_caching=True))


def serve(s: Scheduler, request_id: str, content_hash: str) -> int:
    """Run a request with one image to its end; the prompt tokens it found cached."""
    tokens, media = prompt_with(content_hash)
    request = Request(request_id, tokens, SamplingParams(max_tokens=1), media=media)
    s.add_request(request)
    while s.has_unfinished_requests():
        out = s.schedule()
        resolve_step(s, out, {x.request_id: 7 for x in out.scheduled if x.samples})
    return request.num_cached_tokens


def test_only_the_blocks_an_image_occupies_take_its_hash():
    _, media = prompt_with("cat")
    assert [media.block_keys(i, BLOCK) for i in range(4)] == [(), ("cat",), ("cat",), ()]


def test_the_same_picture_hits_the_cache_and_another_misses_after_its_first_block():
    s = scheduler()
    assert serve(s, "first", "cat") == 0
    assert serve(s, "same picture", "cat") == 12  # all full blocks but the last token's
    assert serve(s, "other picture", "dog") == BLOCK  # the text before the image only


def test_a_step_admitting_a_request_with_images_hands_the_runner_its_media():
    s = scheduler()
    tokens, media = prompt_with("cat")
    s.add_request(Request("r", tokens, SamplingParams(max_tokens=2), media=media))
    out = s.schedule()
    assert out.scheduled[0].media is media


class CountingTower:
    """Features whose rows say which image and token they are: `row i = [index, i]`."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, images):
        self.calls.append([i.content_hash for i in images])
        return [Features(mx.array([[float(i.offset), float(t)] for t in range(i.length)]))
                for i in images]


class Features:
    def __init__(self, embeds: mx.array) -> None:
        self.embeds = embeds
        self.deepstack = (embeds * 10,)


def scheduled(request_id: str, start: int, count: int) -> ScheduledRequest:
    return ScheduledRequest(request_id, [PAD] * count, start, [], 0, False,
                            SamplingParams(), 0)


def test_a_chunk_through_an_image_takes_its_part_and_the_next_chunk_the_cached_rest():
    tower = CountingTower()
    cache = EncoderCache(tower, budget_bytes=1 << 20)
    media = {"r": PromptMedia((image(5, 6, "cat"),))}  # "text" has no images
    first = [scheduled("text", 30, 1), scheduled("r", 0, 8)]  # tokens 0..7: image tokens 5-7
    images = step_images(first, media, np.array([0, 1, 9]), cache)
    assert images.rows.tolist() == [6, 7, 8]
    assert images.embeds[:, 1].tolist() == [0, 1, 2]
    assert images.deepstack[0][:, 1].tolist() == [0, 10, 20]
    second = [scheduled("r", 8, 8)]  # tokens 8..15: image tokens 8-10
    images = step_images(second, media, np.array([0, 8]), cache)
    assert images.rows.tolist() == [0, 1, 2]
    assert images.embeds[:, 1].tolist() == [3, 4, 5]
    assert tower.calls == [["cat"]]  # encoded once, by the chunk that first needed it
    assert step_images([scheduled("r", 16, 1)], media, np.array([0, 1]), cache) is None


def test_the_encoder_cache_drops_the_least_recently_used_past_its_budget():
    tower = CountingTower()
    one_image = 6 * 2 * 4 * 2  # embeds and one deepstack layer, float32
    cache = EncoderCache(tower, budget_bytes=2 * one_image)
    a, b, c = image(0, 6, "a"), image(0, 6, "b"), image(0, 6, "c")
    cache.features([a, b])
    cache.features([a])  # a is now the most recent
    cache.features([c])  # evicts b
    cache.features([a, b])
    assert tower.calls == [["a", "b"], ["c"], ["b"]]
    assert cache.num_bytes <= cache.budget_bytes


def test_positions_are_three_axis_only_in_steps_holding_image_rows():
    table = np.stack([np.arange(6), np.arange(6) * 2, np.arange(6) * 3])
    media = {"r": PromptMedia((), positions=MropePositions(table, delta=-2))}
    flat = np.array([40, 41, 3, 4, 5, 6], np.int32)
    text_only = [scheduled("t", 40, 2)]
    assert step_positions(text_only, media, flat[:2]).tolist() == [40, 41]
    mixed = [scheduled("t", 40, 2), scheduled("r", 3, 4)]  # prompt tokens 3-5, then one more
    positions = step_positions(mixed, media, flat)
    assert positions.tolist() == [[40, 41, 3, 4, 5, 4], [40, 41, 6, 8, 10, 4],
                                  [40, 41, 9, 12, 15, 4]]
    decode = [scheduled("t", 42, 1), scheduled("r", 7, 1)]  # past its prompt: index + delta
    assert step_positions(decode, media, np.array([42, 7], np.int32)).tolist() == [42, 5]
