"""The text model's side of images for the Qwen vision-language families, against transformers
(PyTorch, fp32, CPU): the image features come from transformers' own vision tower, our text
model takes them as a step's image rows (models/step_images.py) with multimodal-rope positions
(models/mrope_positions.py), and its logits must equal the ForConditionalGeneration's.

Prompts are fed in one step or in chunks that cut through an image (each chunk carrying its
own image rows), and a token after the prompt comes in a text-only step (1-D positions, shifted
by the prompt's delta).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from engine_helpers import make_runner_and_scheduler
from tiny_models import IMAGE_TOKENS, QWEN_VISION, build_tiny_model

from convert import convert_model
from metal_engine.input_batch import build_step_inputs
from metal_engine.models.mrope_positions import MropePositions, mrope_positions
from metal_engine.models.rope import RotaryEmbedding
from metal_engine.models.rope_parameters import RopeParameters
from metal_engine.models.step_images import StepImages
from scheduler import Request, SamplingParams

TOL = 1e-4
IMAGE, START, END = (IMAGE_TOKENS[k] for k in ("image_token_id", "vision_start_token_id",
                                               "vision_end_token_id"))
MERGE = QWEN_VISION["spatial_merge_size"]
PATCH_WIDTH = 3 * QWEN_VISION["temporal_patch_size"] * QWEN_VISION["patch_size"] ** 2


def _image(grid: tuple[int, int, int]) -> list[int]:
    t, h, w = grid
    return [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]


# name -> (token ids with images, each image's (t, h, w) patch grid); wide and tall images.
PROMPTS = {
    "one-image": ([5, 9, 17, 3, *_image((1, 4, 6)), 40, 41, 8], [(1, 4, 6)]),
    "two-images": ([7, *_image((1, 4, 6)), 33, 12, 90, 4, *_image((1, 6, 2)), 61, 62],
                   [(1, 4, 6), (1, 6, 2)]),
}
NEXT_TOKEN = 77  # fed after the prompt in a text-only step


@pytest.fixture(scope="module", params=["qwen3_vl_text", "qwen3_vl_moe_text", "qwen3_5_text",
                                                "qwen3_5_moe_text"])
def vision_model(request, tmp_path_factory):
    """(transformers vision-language model, our converted text model's dir)."""
    source = tmp_path_factory.mktemp(f"{request.param}-hf")
    model = build_tiny_model(request.param, source, vision=True)
    out = convert_model(source, tmp_path_factory.mktemp(request.param) / "model",
                        progress=False)
    return model, out


def torch_inputs(ids: list[int], grids: list[tuple[int, int, int]]) -> dict:
    patches = sum(t * h * w for t, h, w in grids)
    generator = torch.Generator().manual_seed(len(ids))
    input_ids = torch.tensor([ids])
    return dict(input_ids=input_ids, image_grid_thw=torch.tensor(grids),
                pixel_values=torch.randn(patches, PATCH_WIDTH, generator=generator),
                mm_token_type_ids=(input_ids == IMAGE).int())


def image_features(model, inputs: dict) -> tuple[np.ndarray, list[np.ndarray]]:
    """transformers' tower's features of the prompt's image tokens, in order: (embeds,
    deepstack features per decoder layer)."""
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"],
                                             return_dict=True)
    embeds = torch.cat(out.pooler_output).numpy()
    deepstack = [torch.cat(f).numpy() for f in getattr(out, "deepstack_features", None) or []]
    return embeds, deepstack


def step_images(ids: np.ndarray, start: int, stop: int, embeds: np.ndarray,
                deepstack: list[np.ndarray]) -> StepImages | None:
    """The image rows of prompt tokens `start..stop-1` (a step of one request), or None."""
    image_tokens = np.flatnonzero(ids == IMAGE)
    feature = np.flatnonzero((image_tokens >= start) & (image_tokens < stop))
    if not len(feature):
        return None
    rows = (image_tokens[feature] - start).astype(np.int32)
    return StepImages(mx.array(rows), mx.array(embeds[feature]),
                      tuple(mx.array(d[feature]) for d in deepstack))


def run_with_images(runner, scheduler, ids: list[int], positions: MropePositions,
                    features, chunks: list[int]) -> np.ndarray:
    """Logits of every fed position, `ids` fed at most `chunks[i]` tokens in step i (the
    scheduler may cut a hybrid model's chunks shorter); a step with image rows gets 3-D
    positions, the others 1-D ones."""
    request = Request("a", ids, SamplingParams(max_tokens=1, temperature=0.0))
    scheduler.add_request(request)
    states, token_ids, rows = runner.cache.states, np.array(ids), []
    sizes = iter(chunks)
    while request.num_computed_tokens < len(ids):
        out = scheduler.schedule()
        scheduled = out.scheduled[0]
        scheduled.token_ids = scheduled.token_ids[:next(sizes, len(ids))]
        scheduled.samples = False
        start = request.num_computed_tokens
        stop = start + len(scheduled.token_ids)
        images = step_images(token_ids, start, stop, *features)
        step_positions = positions.rows(start, stop)
        if images is None:
            step_positions = step_positions[0]
        step = build_step_inputs(out, runner.cache.block_size)
        if states is not None:  # as the runner restores, binds and saves the request's state
            states.copy(out.state_plan.restores)
            states.bind(out.scheduled)
        hidden = runner.model(mx.array(step.input_ids), mx.array(step_positions),
                              step.attention, runner.cache, images)
        if states is not None:
            states.copy(out.state_plan.saves)
        logits = runner.model.logits(hidden)
        mx.eval(logits, runner.cache.arrays())
        rows.append(np.array(logits))
        request.num_computed_tokens = stop
    return np.concatenate(rows)


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_positions_equal_get_rope_index(vision_model, prompt):
    model, _ = vision_model
    ids, grids = PROMPTS[prompt]
    inputs = torch_inputs(ids, grids)
    theirs, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                               inputs["image_grid_thw"])
    ours = mrope_positions(ids, IMAGE, grids, MERGE)
    np.testing.assert_array_equal(ours.prompt, theirs[:, 0].numpy())
    assert ours.delta == int(delta)


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("chunks", ["whole-prompt", "through-the-images"])
def test_image_prompt_logits_match_transformers(vision_model, prompt, chunks):
    model, path = vision_model
    ids, grids = PROMPTS[prompt]
    inputs = torch_inputs([*ids, NEXT_TOKEN], grids)
    with torch.no_grad():
        expected = model(**inputs).logits[0].numpy()
    sizes = [len(ids)] if chunks == "whole-prompt" else [3, 4, 5, len(ids) - 12]
    runner, scheduler = make_runner_and_scheduler(path, block_size=8)
    got = run_with_images(runner, scheduler, [*ids, NEXT_TOKEN],
                          mrope_positions(ids, IMAGE, grids, MERGE),
                          image_features(model, inputs), [*sizes, 1])
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("backend", ["metal", "reference"])
def test_every_backend_turns_image_rows_as_transformers(vision_model, backend):
    """The Metal path's graph (`mx.fast.rope` for 1-D steps, float32 tables for 3-D ones)
    and the pure-MLX reference, run on MLX's CPU backend."""
    model, path = vision_model
    ids, grids = PROMPTS["two-images"]
    inputs = torch_inputs([*ids, NEXT_TOKEN], grids)
    with torch.no_grad():
        expected = model(**inputs).logits[0].numpy()
    runner, scheduler = make_runner_and_scheduler(path, block_size=8)
    runner.model.use_ops(backend)
    got = run_with_images(runner, scheduler, [*ids, NEXT_TOKEN],
                          mrope_positions(ids, IMAGE, grids, MERGE),
                          image_features(model, inputs), [5, len(ids) - 5, 1])
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=TOL)


def test_rope_tables_equal_transformers_multimodal_rope():
    """cos/sin of random 3-D positions against transformers' Qwen3-VL rotary embedding
    (interleaved sections), and 3 equal positions against the 1-D path."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    section = (6, 5, 5)
    config = Qwen3VLTextConfig(head_dim=32, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, mrope_section=list(section)))
    positions = np.random.default_rng(0).integers(0, 300, size=(3, 9))
    cos, sin = Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1),
                                                  torch.tensor(positions)[:, None])
    rope = RotaryEmbedding(RopeParameters(mrope_section=section), 32, 256)
    ours = rope.tables(mx.array(positions), meta=None)
    for got, theirs in zip(ours, (cos, sin), strict=True):
        np.testing.assert_allclose(np.array(got[:, 0]), theirs[0, :, :16].numpy(), atol=1e-6)
    text = mx.array(np.repeat(positions[:1], 3, axis=0))
    for three_d, one_d in zip(rope.tables(text, None), rope.tables(text[0], None), strict=True):
        np.testing.assert_array_equal(np.array(three_d), np.array(one_d))


def test_positions_past_the_prompt_are_shifted_by_delta():
    ids, grids = PROMPTS["one-image"]
    positions = mrope_positions(ids, IMAGE, grids, MERGE)
    n = len(ids)
    rows = positions.rows(n - 2, n + 3)
    np.testing.assert_array_equal(rows[:, :2], positions.prompt[:, -2:])
    np.testing.assert_array_equal(rows[:, 2:], np.tile(np.arange(n, n + 3) + positions.delta,
                                                       (3, 1)))
    assert positions.delta == int(positions.prompt.max()) + 1 - n


def test_image_tokens_that_do_not_fit_the_grids_are_refused():
    ids, _ = PROMPTS["one-image"]
    with pytest.raises(ValueError, match="6 image tokens, its image grids"):
        mrope_positions(ids, IMAGE, [(1, 4, 4)], MERGE)


def test_deepstack_stretches_cut_by_absolute_layer():
    images = StepImages(mx.zeros(2, mx.int32), mx.zeros((2, 4)),
                        (mx.zeros((2, 4)), mx.zeros((2, 4))))
    assert images.stretches(range(0, 4)) == [range(0, 1), range(1, 2), range(2, 4)]
    assert images.stretches(range(1, 3)) == [range(1, 2), range(2, 3)]  # a pipeline stage
    assert images.stretches(range(2, 4)) == [range(2, 4)]
    with pytest.raises(ValueError, match=r"deepstack\[1\] must be \[2, hidden\]"):
        StepImages(mx.zeros(2, mx.int32), mx.zeros((2, 4)), (mx.zeros((2, 4)), mx.zeros((3, 4))))
