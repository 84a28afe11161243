"""A prompt's images in the scheduler and the runner, with no model: block hashes keyed by
image content, the encoder cache group's budgets (what it holds, what a step encodes), the
runner's features as its plans say, the rows and positions a step gives them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from scheduler_helpers import resolve_step

from metal_engine.models.mrope_positions import MropePositions
from metal_engine.vision.encoder_cache import EncoderCache
from metal_engine.vision.step_media import step_images, step_positions
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.media import ImageSpan, PromptMedia
from scheduler.output import EncoderPlan, ScheduledRequest

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
    cache = EncoderCache(tower)
    cat = image(5, 6, "cat")
    media = {"r": PromptMedia((cat,))}  # "text" has no images
    cache.apply(EncoderPlan(encode=[cat]))  # the step whose chunk first reaches it
    first = [scheduled("text", 30, 1), scheduled("r", 0, 8)]  # tokens 0..7: image tokens 5-7
    images = step_images(first, media, np.array([0, 1, 9]), cache)
    assert images.rows.tolist() == [6, 7, 8]
    assert images.embeds[:, 1].tolist() == [0, 1, 2]
    assert images.deepstack[0][:, 1].tolist() == [0, 10, 20]
    cache.apply(EncoderPlan())
    second = [scheduled("r", 8, 8)]  # tokens 8..15: image tokens 8-10
    images = step_images(second, media, np.array([0, 8]), cache)
    assert images.rows.tolist() == [0, 1, 2]
    assert images.embeds[:, 1].tolist() == [3, 4, 5]
    assert tower.calls == [["cat"]]  # encoded once, by the chunk that first needed it
    assert step_images([scheduled("r", 16, 1)], media, np.array([0, 1]), cache) is None
    cache.apply(EncoderPlan(free=["cat"]))
    with pytest.raises(RuntimeError, match="did not plan"):
        step_images(second, media, np.array([0, 8]), cache)


def encoder_scheduler(cache_rows: int, step_rows: int, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=64, block_size=BLOCK, max_num_seqs=4,
                                     max_num_batched_tokens=budget, max_model_len=128,
                                     encoder_cache_rows=cache_rows, encoder_step_rows=step_rows))


def add(s: Scheduler, request_id: str, *pictures: tuple[int, int, str]) -> None:
    """A 40-token prompt with images (offset, length, content hash)."""
    media = PromptMedia(tuple(image(*p) for p in pictures))
    first = 100 * ord(request_id[0])  # prompts of their own: no prefix shared
    s.add_request(Request(request_id, list(range(first, first + 40)),
                          SamplingParams(max_tokens=2), media=media))


def step(s: Scheduler) -> tuple[dict[str, tuple[int, int]], list[str], list[str]]:
    """One step resolved: each request's chunk, the images encoded and those freed."""
    out = s.schedule()
    resolve_step(s, out, {x.request_id: 7 for x in out.scheduled if x.samples})
    chunks = {x.request_id: (x.start_position, x.start_position + len(x.token_ids))
              for x in out.scheduled}
    return (chunks, [i.content_hash for i in out.encoder_plan.encode],
            out.encoder_plan.free)


def test_a_step_encodes_no_more_than_its_budget_and_a_chunk_waits_before_the_image():
    s = encoder_scheduler(cache_rows=64, step_rows=10)
    add(s, "a", (4, 8, "cat"))
    add(s, "b", (12, 8, "dog"))  # the step's budget is spent on cat: b stops before dog
    add(s, "c", (0, 6, "cow"))  # starts with an image over what is left: c waits
    chunks, encoded, _ = step(s)
    assert chunks == {"a": (0, 40), "b": (0, 12)} and encoded == ["cat"]
    chunks, encoded, _ = step(s)
    assert chunks["b"] == (12, 40) and encoded == ["dog"]
    assert "c" not in chunks  # dog and cow (16 rows) are over one step's 10
    chunks, encoded, _ = step(s)
    assert chunks["c"] == (0, 40) and encoded == ["cow"]
    assert s.group("encoder").usage() == (22, 64)


def test_the_same_picture_is_encoded_once_and_the_least_recently_used_goes_first():
    s = encoder_scheduler(cache_rows=16, step_rows=16)
    add(s, "a", (4, 8, "cat"), (20, 8, "dog"))
    assert step(s)[1:] == (["cat", "dog"], [])
    add(s, "b", (0, 8, "dog"))  # found cached: dog is now the most recent
    assert step(s)[1:] == ([], [])
    add(s, "c", (0, 8, "cow"))
    assert step(s)[1:] == (["cow"], ["cat"])
    group = s.group("encoder")
    assert (group.num_encoded, group.num_hits) == (3, 1)


def test_an_image_a_request_reads_in_a_later_chunk_stays_until_a_step_is_past_it():
    s = encoder_scheduler(cache_rows=10, step_rows=10, budget=24)
    add(s, "a", (20, 10, "cat"))  # its first chunk of 24 cuts through cat
    assert step(s) == ({"a": (0, 24)}, ["cat"], [])
    add(s, "b", (0, 10, "dog"))  # the cache holds only cat, which a reads again: b waits
    assert step(s) == ({"a": (24, 40)}, [], [])
    chunks, encoded, freed = step(s)  # a is past cat: cat makes way for dog
    assert chunks == {"a": (40, 41), "b": (0, 23)} and encoded == ["dog"] and freed == ["cat"]


def test_a_cached_image_a_chunk_reads_is_not_evicted_for_another_it_encodes():
    """The chunk reads cached cat and needs dog; the cache holds one of them: the chunk ends
    before dog, which is encoded in the next step in cat's place."""
    s = encoder_scheduler(cache_rows=8, step_rows=16)
    add(s, "a", (0, 8, "cat"))
    assert step(s)[1:] == (["cat"], [])
    add(s, "b", (4, 8, "cat"), (20, 8, "dog"))
    chunks, encoded, freed = step(s)  # beside a's last decode
    assert chunks["b"] == (0, 20) and encoded == freed == []
    chunks, encoded, freed = step(s)
    assert chunks["b"] == (20, 40) and encoded == ["dog"] and freed == ["cat"]


def test_a_chunk_ends_before_a_cached_image_whose_room_an_earlier_one_takes():
    """dog (missing) then cat (cached) in one chunk, room for 12 rows: dog goes in cat's place
    and the chunk ends before cat, which the next step encodes again."""
    s = encoder_scheduler(cache_rows=12, step_rows=16)
    add(s, "a", (0, 8, "cat"))
    assert step(s)[1:] == (["cat"], [])
    add(s, "b", (4, 8, "dog"), (20, 8, "cat"))
    chunks, encoded, freed = step(s)
    assert chunks["b"] == (0, 20) and encoded == ["dog"] and freed == ["cat"]
    chunks, encoded, freed = step(s)
    assert chunks["b"] == (20, 40) and encoded == ["cat"] and freed == ["dog"]
    assert s.group("encoder").usage() == (8, 12)


def test_an_image_over_the_budgets_is_encoded_alone():
    s = encoder_scheduler(cache_rows=8, step_rows=4)
    add(s, "a", (2, 12, "big"))
    assert step(s) == ({"a": (0, 40)}, ["big"], [])
    add(s, "b", (0, 3, "small"))
    assert step(s)[1:] == (["small"], ["big"])


def test_whole_images_belong_to_the_encoder_group():
    with pytest.raises(ValueError, match="encoder_cache_rows"):
        SchedulerConfig(num_blocks=8, whole_images=True)


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
