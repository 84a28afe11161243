"""Gemma 3's and Gemma 4's vision towers and image processors against transformers: tiny
random multimodal checkpoints saved by `save_pretrained`, the processors' pixels against
transformers' PIL image processors, the towers' soft tokens against `get_image_features`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from tiny_models import save_word_tokenizer
from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask
from transformers.models.gemma4.image_processing_pil_gemma4 import (
    get_aspect_ratio_preserving_size,
)

from convert import convert_model
from metal_engine.loading.weights import load_model
from metal_engine.vision.gemma3_processor import Gemma3ImageProcessor
from metal_engine.vision.gemma4_processor import Gemma4ImageProcessor
from metal_engine.vision.gemma_config import read_gemma_vision
from metal_engine.vision.gemma_loading import load_gemma_vision
from metal_engine.vision.gemma_text_side import image_blocks
from metal_engine.vision.image_model import load_image_model

TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, pad_token_id=0)
IMAGE_TOKEN, BOI, EOI = 127, 125, 126


def _images() -> list[Image.Image]:
    """A wide RGB image and a tall one with transparency (composited over white)."""
    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 256, (45, 100, 3), dtype=np.uint8))
    tall = Image.fromarray(rng.integers(0, 256, (90, 41, 4), dtype=np.uint8), mode="RGBA")
    return [wide, tall]


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight moved off its initial value, so a misread one cannot go unnoticed."""
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8, vision_use_head=False)
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**TEXT).to_dict(),
        vision_config=vision.to_dict(), mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN,
        boi_token_index=BOI, eoi_token_index=EOI)
    model = _perturbed(transformers.Gemma3ForConditionalGeneration(config))
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(path)
    transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, patch_size=4, pooling_kernel_size=2,
        position_embedding_size=64, use_clipped_linears=True, standardize=True)
    text = transformers.Gemma4TextConfig(**TEXT, hidden_size_per_layer_input=0)
    config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       audio_config=None, image_token_id=IMAGE_TOKEN,
                                       boi_token_id=BOI, eoi_token_id=EOI)
    model = _perturbed(transformers.Gemma4ForConditionalGeneration(config))
    with torch.no_grad():  # finite clip bounds that bite, and a standardization that shows
        for name, buffer in model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-1.5)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(1.5)
            elif name.endswith(("std_bias", "std_scale")):
                buffer.copy_(0.5 + torch.rand_like(buffer))
    path = tmp_path_factory.mktemp("gemma4")
    model.save_pretrained(path)
    transformers.Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2,
                                         max_soft_tokens=70).save_pretrained(path)
    return path, model


def test_gemma3_config_reads_tokens_and_tower(gemma3) -> None:
    path, _ = gemma3
    config = read_gemma_vision(transformers.Gemma3Config.from_pretrained(path).to_dict())
    assert (config.tokens.image_token_id, config.tokens.boi_token_id,
            config.tokens.eoi_token_id) == (IMAGE_TOKEN, BOI, EOI)
    assert (config.mm_tokens_per_image, config.text_hidden_size) == (4, 64)
    assert (config.vision.image_size, config.vision.patch_size) == (32, 8)
    assert config.tokens.around(2) == [BOI, IMAGE_TOKEN, IMAGE_TOKEN, EOI]


def test_gemma3_processor_matches_transformers(gemma3) -> None:
    path, _ = gemma3
    ours = Gemma3ImageProcessor.from_model_dir(path, load_gemma_vision(path, mx.float32).config)
    theirs = transformers.Gemma3ImageProcessorPil.from_pretrained(path)
    expected = theirs(_images(), return_tensors="np")["pixel_values"]
    for image, pixels in zip(_images(), expected, strict=True):
        processed = ours(image)
        assert processed.pixel_values.dtype == np.float32 and processed.num_tokens == 4
        np.testing.assert_allclose(processed.pixel_values, pixels, atol=1e-5, rtol=0)


BACKENDS = ["host", "reference", "metal"]  # the ops the tower computes with


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count", [1, 2])
def test_gemma3_tower_matches_get_image_features(gemma3, count: int, backend: str) -> None:
    path, model = gemma3
    tower = load_gemma_vision(path, mx.float32)
    tower.use_ops(backend)
    processor = Gemma3ImageProcessor.from_model_dir(path, tower.config)
    images = [processor(image) for image in _images()[:count]]
    features = tower.encode(images)
    with torch.no_grad():
        pixels = torch.from_numpy(np.stack([image.pixel_values for image in images]))
        expected = model.get_image_features(pixels).pooler_output
    assert features.embeds.shape == (4 * count, 64) and features.deepstack == ()
    np.testing.assert_allclose(np.array(features.embeds), expected.reshape(-1, 64).numpy(),
                               atol=1e-4, rtol=0)


def test_gemma4_processor_matches_transformers(gemma4) -> None:
    path, _ = gemma4
    config = read_gemma_vision(transformers.Gemma4Config.from_pretrained(path).to_dict())
    ours = Gemma4ImageProcessor.from_model_dir(path, config)
    theirs = transformers.Gemma4ImageProcessorPil.from_pretrained(path)
    expected = theirs(_images(), return_tensors="np")
    for i, image in enumerate(_images()):
        processed = ours(image)
        real = (expected["image_position_ids"][i] >= 0).all(axis=-1)
        rows, cols = processed.grid
        assert processed.num_tokens == expected["num_soft_tokens_per_image"][i] == rows * cols // 4
        np.testing.assert_allclose(processed.pixel_values, expected["pixel_values"][i][real],
                                   atol=1e-5, rtol=0)
        # Positions are (column, row), row-major: what the tower derives from the grid.
        positions = expected["image_position_ids"][i][real]
        assert positions[:, 0].max() + 1 == cols and positions[:, 1].max() + 1 == rows


@pytest.mark.parametrize("budget", [70, 280, 1120])
def test_gemma4_sizes_match_transformers(budget: int) -> None:
    """Square, wide, tall, and so thin that one side keeps a single row of kernels."""
    processor = Gemma4ImageProcessor(patch_size=16, pooling_kernel_size=3, max_soft_tokens=budget)
    for height, width in [(224, 224), (480, 640), (1000, 300), (20, 3000), (4000, 30), (7, 9)]:
        expected = get_aspect_ratio_preserving_size(height, width, 16, budget * 9, 3)
        assert processor.target_size(height, width) == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count", [1, 2])
def test_gemma4_tower_matches_get_image_features(gemma4, count: int, backend: str) -> None:
    path, model = gemma4
    tower = load_gemma_vision(path, mx.float32)
    tower.use_ops(backend)
    processor = Gemma4ImageProcessor.from_model_dir(path, tower.config)
    images = [processor(image) for image in _images()[:count]]
    features = tower.encode(images)
    batch = transformers.Gemma4ImageProcessorPil.from_pretrained(path)(
        _images()[:count], return_tensors="pt")
    with torch.no_grad():
        expected = model.get_image_features(batch["pixel_values"],
                                            batch["image_position_ids"]).pooler_output
    expected = torch.cat(expected).numpy()
    assert features.embeds.shape == (sum(image.num_tokens for image in images), 64)
    np.testing.assert_allclose(np.array(features.embeds), expected, atol=1e-4, rtol=0)


def mlx_vlm_dir(source: Path, out: Path, bits: int | None = None) -> Path:
    """The dir mlx-vlm's convert writes from the Hugging Face checkpoint `source`: no
    `model.` prefix, the text model under `language_model.model.`, Gemma 3's SigLIP model
    under `vision_tower.vision_model.` with its patch convolution channel-last; with `bits`,
    every Linear whose input width divides by 32 quantized (the tower's included)."""
    tensors = {}
    for name, tensor in mx.load(str(source / "model.safetensors")).items():
        name = name.removeprefix("model.")
        if name.startswith("language_model.") and not name.startswith("language_model.model."):
            name = name.replace("language_model.", "language_model.model.", 1)
        if name.startswith("vision_tower.encoder") or name.startswith("vision_tower.embeddings"):
            name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)
        if name.endswith("patch_embedding.weight"):
            tensor = tensor.transpose(0, 2, 3, 1)
        tensors[name] = tensor
    config = json.loads((source / "config.json").read_text())
    if bits is not None:
        for name in [n for n, t in tensors.items() if n.endswith(".weight")
                     and t.ndim == 2 and t.shape[-1] % 32 == 0]:
            module = name.removesuffix(".weight")
            tensors[name], tensors[f"{module}.scales"], tensors[f"{module}.biases"] = (
                mx.quantize(tensors[name], group_size=32, bits=bits))
        config["quantization"] = config["quantization_config"] = {"group_size": 32,
                                                                  "bits": bits}
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    for side_file in source.glob("*processor_config.json"):
        (out / side_file.name).write_bytes(side_file.read_bytes())
    save_word_tokenizer(out)
    return out


def assert_same_features(model_dir: Path, reference_dir: Path, atol: float = 0.0) -> None:
    """The dir's vision side encodes each test image as the reference dir's tower does
    (exactly unless `atol`)."""
    ours, reference = load_image_model(model_dir, mx.float32), load_gemma_vision(reference_dir,
                                                                                mx.float32)
    assert ours is not None
    for image in _images():
        _, processed = ours.process(SimpleNamespace(image=image, content_hash="", detail="auto"))
        got = np.array(ours.tower.encode([processed]).embeds)
        want = np.array(reference.encode([processed]).embeds)
        np.testing.assert_allclose(got, want, atol=atol, rtol=0)
        assert atol == 0 or not np.array_equal(got, want)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_the_mlx_vlm_float_layout_loads_and_converts_keeping_the_tower(family, request,
                                                                       tmp_path) -> None:
    path, _ = request.getfixturevalue(family)
    theirs = mlx_vlm_dir(path, tmp_path / "mlx-vlm")
    load_model(theirs, mx.float32)
    assert_same_features(theirs, path)
    out = convert_model(theirs, tmp_path / "out", progress=False)
    tensors = mx.load(str(out / "model.safetensors"))
    assert any(n.startswith("model.vision_tower.") for n in tensors)
    load_model(out, mx.float32)  # the text model loads past the tower
    assert_same_features(out, path)


def test_a_quantized_mlx_vlm_dir_is_served_as_it_is(gemma4, tmp_path: Path) -> None:
    """Conversion refuses MLX's quantized layout (the text model's weights are quantized as
    well as the tower's); the dir loads as it is, its tower dequantized."""
    path, _ = gemma4
    theirs = mlx_vlm_dir(path, tmp_path / "mlx-vlm", bits=8)
    assert any(n.startswith("vision_tower.") and n.endswith(".scales")
               for n in mx.load(str(theirs / "model.safetensors")))
    with pytest.raises(ValueError, match="already in MLX's quantized layout: serve it as it is"):
        convert_model(theirs, tmp_path / "out", progress=False)
    load_model(theirs, mx.float32)
    assert_same_features(theirs, path, atol=0.05)


def test_text_only_dir_has_no_tower(tmp_path: Path) -> None:
    transformers.Gemma3TextConfig(**TEXT).save_pretrained(tmp_path)
    assert load_gemma_vision(tmp_path, mx.float32) is None


def test_image_blocks_match_transformers() -> None:
    ids = np.array([5, BOI, IMAGE_TOKEN, IMAGE_TOKEN, EOI, BOI, IMAGE_TOKEN, EOI, 7, IMAGE_TOKEN])
    token_types = torch.from_numpy((ids == IMAGE_TOKEN).astype(np.int64))[None]
    expected = get_block_sequence_ids_for_mask(token_types)[0].numpy()
    np.testing.assert_array_equal(image_blocks(ids, IMAGE_TOKEN), expected)
    assert image_blocks(ids, IMAGE_TOKEN).tolist() == [-1, -1, 0, 0, -1, -1, 1, -1, -1, 2]
