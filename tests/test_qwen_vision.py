"""The Qwen vision side against transformers: image preprocessing (Qwen2VLImageProcessorPil,
which Qwen3-VL and Qwen3.5 use; a request's detail level too), the tower's embeddings and
deepstack features (`get_image_features` of tiny random Qwen3-VL and Qwen3.5 checkpoints),
loading from `save_pretrained` dirs and mlx-vlm's layout, and conversion keeping the tower."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from mlx_dirs import mlx_lm_hybrid_tensors, save_mlx_dir
from PIL import Image
from safetensors.numpy import load_file
from tiny_models import COMMON, TINY_MODELS, VOCAB
from tokenizers import Tokenizer, models
from transformers import Qwen2VLImageProcessorPil

from convert import convert_model
from metal_engine.loading.weights import load_model
from metal_engine.vision.image_model import LOW_DETAIL_TOKENS, load_image_model
from metal_engine.vision.pixels import IMAGE_PROCESSOR_CONFIG
from metal_engine.vision.qwen_image_processing import (
    QwenImageProcessing,
    image_token_count,
    preprocess_image,
)
from metal_engine.vision.qwen_vision_config import (
    ImageTokenIds,
    read_image_token_ids,
    read_vision_config,
)
from metal_engine.vision.qwen_vision_loading import load_vision_tower

PATCH = {"qwen3_vl": 16, "qwen3_5": 14}
# Pixel bounds small enough that the test images are scaled up and down.
PIXELS = {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 12}
# (width, height): tiny (scaled up to min_pixels), not a multiple of the factor, wide, and
# scaled down to max_pixels.
SIZES = [(9, 7), (45, 70), (300, 40), (400, 333)]


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def hf_processor(patch: int, **overrides) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(patch_size=patch, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, **{"size": PIXELS, **overrides})


def saved_options(processor: Qwen2VLImageProcessorPil, folder: Path) -> QwenImageProcessing:
    processor.save_pretrained(folder)
    return QwenImageProcessing.from_model_dir(folder)


def assert_same_processing(ours: QwenImageProcessing, theirs, image: Image.Image,
                           **bounds) -> None:
    want = theirs(image, return_tensors="np",
                  **({"size": {"shortest_edge": bounds["min_pixels"],
                               "longest_edge": bounds["max_pixels"]}} if bounds else {}))
    got = preprocess_image(image, ours, **bounds)
    assert got.grid == tuple(want["image_grid_thw"][0])
    np.testing.assert_allclose(got.pixel_values, want["pixel_values"], atol=1e-5, rtol=0)
    tokens = image_token_count(image.height, image.width, ours, **bounds)
    assert tokens == got.num_tokens == want["pixel_values"].shape[0] // 4


@pytest.mark.parametrize("spelling", ["size", "min_max_pixels"])
def test_preprocessing_matches_transformers(spelling: str, tmp_path: Path) -> None:
    """Both spellings of the pixel bounds, every kind of resize, as transformers computes."""
    processor = hf_processor(14, resample=Image.Resampling.BILINEAR)
    processor.save_pretrained(tmp_path)
    if spelling == "min_max_pixels":  # how Qwen2-VL era checkpoints wrote the bounds
        path = tmp_path / IMAGE_PROCESSOR_CONFIG
        raw = json.loads(path.read_text())
        raw.pop("size")
        raw.update(min_pixels=PIXELS["shortest_edge"], max_pixels=PIXELS["longest_edge"])
        path.write_text(json.dumps(raw))
        processor = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    ours = QwenImageProcessing.from_model_dir(tmp_path)
    assert (ours.min_pixels, ours.max_pixels) == (PIXELS["shortest_edge"], PIXELS["longest_edge"])
    for width, height in SIZES:
        assert_same_processing(ours, processor, random_image(width, height))


def test_a_request_overrides_the_pixel_bounds_and_modes_convert(tmp_path: Path) -> None:
    """Per-request bounds (the API's detail levels) resize as transformers' `size` does;
    transparent images are put on white, grey ones made RGB."""
    processor = hf_processor(16)
    ours = saved_options(processor, tmp_path)
    image = random_image(400, 333)
    for bounds in ({"min_pixels": 32 * 32, "max_pixels": 32 * 32 * 4},
                   {"min_pixels": 32 * 32 * 20, "max_pixels": 32 * 32 * 40}):
        assert_same_processing(ours, processor, image, **bounds)
    assert_same_processing(ours, processor, random_image(50, 60, "RGBA", seed=1))
    assert_same_processing(ours, processor, random_image(50, 60, "L", seed=2))


def build_checkpoint(family: str, folder: Path):
    """A tiny random `family` multimodal checkpoint saved in `folder` (weights, tokenizer,
    preprocessor_config.json) and its float32 PyTorch model."""
    torch.manual_seed(0)
    vision = dict(hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                  patch_size=PATCH[family], num_position_embeddings=16)
    if family == "qwen3_vl":
        text = transformers.Qwen3VLTextConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "mrope_section": [2, 3, 3]})
        config = transformers.Qwen3VLConfig(
            text_config=text.to_dict(), vision_config=transformers.Qwen3VLVisionConfig(
                depth=3, deepstack_visual_indexes=[0, 2], **vision).to_dict())
        model = transformers.Qwen3VLForConditionalGeneration(config)
    else:
        text = transformers.Qwen3_5TextConfig(**{**COMMON, **TINY_MODELS["qwen3_5_text"][2]})
        config = transformers.Qwen3_5Config(
            text_config=text.to_dict(),
            vision_config=transformers.Qwen3_5VisionConfig(depth=2, **vision).to_dict())
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():  # norms off 1, biases off 0
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.eval().save_pretrained(folder)
    hf_processor(PATCH[family]).save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(folder / "tokenizer.json"))
    return model


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, build_checkpoint(request.param, folder), folder


def hf_features(model, folder: Path, images: list[Image.Image]):
    """transformers' (embeds, deepstack features) of the images, as it preprocesses them."""
    inputs = Qwen2VLImageProcessorPil.from_pretrained(folder)(images, return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    deepstack = [torch.cat(f).numpy() for f in getattr(out, "deepstack_features", None) or []]
    return torch.cat(out.pooler_output).numpy(), deepstack


def assert_same_features(model_dir: Path, model, reference_dir: Path,
                         images: list[Image.Image], backend: str | None = None) -> None:
    """`backend`: the ops the tower computes with (None: the device's)."""
    tower = load_vision_tower(model_dir, mx.float32)
    if backend is not None:
        tower.use_ops(backend)
    options = QwenImageProcessing.from_model_dir(model_dir)
    features = tower.encode([preprocess_image(image, options) for image in images])
    embeds, deepstack = hf_features(model, reference_dir, images)
    np.testing.assert_allclose(np.array(features.embeds), embeds, atol=1e-4, rtol=1e-4)
    assert len(features.deepstack) == len(deepstack) == len(tower.config.deepstack_layers)
    for got, want in zip(features.deepstack, deepstack, strict=True):
        np.testing.assert_allclose(np.array(got), want, atol=1e-4, rtol=1e-4)
    assert sum(features.token_counts) == embeds.shape[0]
    assert features.token_counts == tuple(
        image_token_count(i.height, i.width, options) for i in images)


@pytest.mark.parametrize("backend", ["host", "reference", "metal"])
def test_the_tower_computes_what_transformers_does(checkpoint, backend) -> None:
    """One image, then two of different sizes in one batch (each attends only to itself;
    the learned positions resampled up and down to their grids), on each ops backend the
    text model may compute with (Metal's runs its `mx.fast` path on this device)."""
    family, model, folder = checkpoint
    assert (len(read_vision_config(json.loads((folder / "config.json").read_text()))
                .deepstack_layers) > 0) == (family == "qwen3_vl")
    assert_same_features(folder, model, folder, [random_image(70, 40)], backend)
    assert_same_features(folder, model, folder, [random_image(70, 40), random_image(150, 100)],
                         backend)


def test_low_detail_caps_a_large_picture_at_256_tokens(checkpoint, tmp_path: Path) -> None:
    """Under bounds that give a large picture over 1000 tokens, "low" resizes it within
    256 tokens' pixels as transformers' processor does under those bounds; "auto" and "high"
    keep the checkpoint's bounds and share their cache key, "low" has its own."""
    family, _, folder = checkpoint
    shutil.copytree(folder, tmp_path / "model")
    factor = 2 * PATCH[family]
    hf = hf_processor(PATCH[family], size={"shortest_edge": factor**2 * 4,
                                           "longest_edge": factor**2 * 2048})
    hf.save_pretrained(tmp_path / "model")
    vision = load_image_model(tmp_path / "model", mx.float32)
    big = random_image(1400, 1000)
    spans = {detail: vision.place([vision.placeholder_id], [SimpleNamespace(
        image=big, content_hash="big", detail=detail)])[1].images[0]
        for detail in ("low", "auto", "high")}  # fmt: skip
    low, auto, high = spans.values()
    assert low.length <= LOW_DETAIL_TOKENS < 1000 < auto.length == high.length
    assert low.content_hash != auto.content_hash == high.content_hash
    want = hf(big, return_tensors="np", size={"shortest_edge": factor**2 * 4,
                                              "longest_edge": factor**2 * LOW_DETAIL_TOKENS})
    assert low.processed.grid == tuple(want["image_grid_thw"][0])
    np.testing.assert_allclose(low.processed.pixel_values, want["pixel_values"], atol=1e-5,
                               rtol=0)


def test_the_mlx_vlm_layout_loads_and_converts(checkpoint, tmp_path: Path) -> None:
    """mlx-vlm's dirs: the tower under `vision_tower.`, its conv channel-last; they load as
    they are and convert back to Hugging Face's tensors. mlx-lm's keep no tower."""
    family, model, folder = checkpoint
    hf = mx.load(str(folder / "model.safetensors"))
    text = save_mlx_dir(tmp_path / "mlx-lm", folder, mlx_lm_hybrid_tensors(hf, True), None)
    assert load_vision_tower(text, mx.float32) is None
    tower = {name.replace("model.visual.", "vision_tower.", 1):
             tensor.moveaxis(1, 4) if name.endswith("patch_embed.proj.weight") else tensor
             for name, tensor in hf.items() if name.startswith("model.visual.")}
    theirs = save_mlx_dir(tmp_path / "mlx-vlm", folder,
                          {**mlx_lm_hybrid_tensors(hf, multimodal=True), **tower}, None)
    (theirs / IMAGE_PROCESSOR_CONFIG).write_bytes((folder / IMAGE_PROCESSOR_CONFIG).read_bytes())
    assert tower["vision_tower.patch_embed.proj.weight"].shape[-1] == 3
    assert_same_features(theirs, model, folder, [random_image(70, 40), random_image(90, 60)])
    out = convert_model(theirs, tmp_path / "out", progress=False)
    got, want = load_file(out / "model.safetensors"), load_file(folder / "model.safetensors")
    tower_names = [n for n in want if n.startswith("model.visual.")]
    assert tower_names
    for name in tower_names:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert_same_features(out, model, folder, [random_image(70, 40)])
    load_model(out, mx.float32)  # the text model too


def test_conversion_keeps_the_tower_in_float(tmp_path: Path) -> None:
    """A converted Qwen3.5 dir holds the tower (never quantized), its vision_config, image
    token ids and preprocessor config; the text model loads past it; `text_only` drops it."""
    source = tmp_path / "hf"
    source.mkdir()
    model = build_checkpoint("qwen3_5", source)
    images = [random_image(70, 40), random_image(150, 100)]
    for quantize in (None, 4):
        out = convert_model(source, tmp_path / f"q{quantize}", quantize=quantize, group_size=32,
                            progress=False)
        tensors = mx.load(str(out / "model.safetensors"))
        assert any(n.endswith(".scales") for n in tensors) == (quantize is not None)
        tower = {n: t for n, t in tensors.items() if n.startswith("model.visual.")}
        assert tower and all(t.dtype == mx.float32 for t in tower.values())
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "qwen3_5_text"
        assert read_image_token_ids(config) == ImageTokenIds(248056, 248057, 248053, 248054)
        assert (out / IMAGE_PROCESSOR_CONFIG).is_file()
        load_model(out, mx.float32)  # strict: the tower's tensors are not the text model's
        assert_same_features(out, model, source, images)

    again = convert_model(tmp_path / "qNone", tmp_path / "again", progress=False)
    assert_same_features(again, model, source, images)  # a converted dir converts again
    for text_source in (source, again):
        text_only = convert_model(text_source, tmp_path / "text", progress=False, force=True,
                                  text_only=True)
        names = load_file(text_only / "model.safetensors")
        assert not any(n.startswith("model.visual.") for n in names)
        assert "vision_config" not in json.loads((text_only / "config.json").read_text())
        assert load_vision_tower(text_only, mx.float32) is None
        assert not (text_only / IMAGE_PROCESSOR_CONFIG).exists()


def test_the_config_reader_applies_each_familys_defaults() -> None:
    """Keys left out take transformers' defaults: deepstack at 8, 16, 24 for Qwen3-VL only."""
    for family, deepstack, image_token in [("qwen3_vl", (8, 16, 24), 151655),
                                           ("qwen3_vl_moe", (8, 16, 24), 151655),
                                           ("qwen3_5", (), 248056),
                                           ("qwen3_5_moe", (), 248056)]:
        config = {"model_type": family, "vision_config": {"depth": 27}}
        assert read_vision_config(config).deepstack_layers == deepstack
        assert read_image_token_ids(config).image == image_token
        # A converted dir's text config names the family in its vision_config.
        converted = {"model_type": "x_text", "vision_config": {"model_type": f"{family}_vision"}}
        assert read_vision_config(converted).family == family
    assert read_vision_config({"model_type": "qwen3", "hidden_size": 8}) is None
    with pytest.raises(ValueError, match="deepstack"):
        read_vision_config({"model_type": "qwen3_vl",
                            "vision_config": {"depth": 4, "deepstack_visual_indexes": [5]}})
