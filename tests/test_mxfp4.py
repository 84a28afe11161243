"""GPT-OSS's MXFP4 experts: OpenAI's checkpoint layout converts with its experts kept MXFP4 in
MLX's layout, bit for bit what transformers dequantizes; mlx-community's MXFP4 dirs (as mlx-lm
writes them) load and equal our conversions.

The MXFP4 checkpoints are written here from a tiny random transformers GPT-OSS by an encoder of
the format's own (tests/mxfp4_files.py); the references are transformers' dequantization of the
same blocks and scales, and transformers running the checkpoint (dequantized, on the CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_dirs import assert_same_checkpoint
from mxfp4_files import write_mlx_community_mxfp4, write_openai_mxfp4
from safetensors.numpy import load_file
from tiny_models import VOCAB, build_tiny_model

from convert import convert_model
from convert.model_ref import loads_as_is
from convert.validate import probe_ids, prompt_logits, validate_conversion
from metal_engine.loading import weights
from metal_engine.loading.quantization import MXFP4, QuantizationConfig, QuantParams
from metal_engine.loading.weights import load_model
from metal_engine.models.moe import QuantizedSwitchLinear

MXFP4_ENTRY = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
IDS = probe_ids(VOCAB) * 5  # 40 tokens: every expert is chosen, the gathered pairs sorted


@pytest.fixture(scope="module")
def openai_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpt-oss")
    build_tiny_model("gpt_oss", root / "float")
    return write_openai_mxfp4(root / "float", root / "openai")


@pytest.fixture(scope="module")
def converted(openai_dir, tmp_path_factory) -> Path:
    return convert_model(openai_dir, tmp_path_factory.mktemp("converted") / "out",
                         progress=False)


def transformers_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_experts_equal_transformers_dequantization(openai_dir, converted) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source = load_file(openai_dir / "model.safetensors")
    ours = mx.load(str(converted / "model.safetensors"))
    layers = json.loads((openai_dir / "config.json").read_text())["num_hidden_layers"]
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj",
                                                                          ("down_proj",))):
            # transformers' float layout: [experts, in, out], gate and up columns alternating.
            theirs = convert_moe_packed_tensors(
                torch.from_numpy(source[f"{prefix}.{fused}_blocks"]),
                torch.from_numpy(source[f"{prefix}.{fused}_scales"]), dtype=torch.float32,
            ).numpy()
            for offset, part in enumerate(parts):
                name = f"{prefix}.{part}"
                assert ours[f"{name}.weight"].dtype == mx.uint32
                assert ours[f"{name}.scales"].dtype == mx.uint8
                assert f"{name}.biases" not in ours
                got = mx.dequantize(ours[f"{name}.weight"], ours[f"{name}.scales"],
                                    group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
                expected = theirs[..., offset::len(parts)].transpose(0, 2, 1)
                np.testing.assert_array_equal(np.array(got), expected, err_msg=name)
    config = json.loads((converted / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"] == MXFP4_ENTRY
    assert ours["model.layers.0.mlp.router.weight"].dtype == mx.float32  # the rest stays float


def test_converted_model_computes_what_transformers_does(openai_dir, converted,
                                                         monkeypatch) -> None:
    expected = transformers_logits(openai_dir, IDS)
    dequantized = load_model(converted, mx.float32)  # the CPU backend dequantizes at load
    assert not any(isinstance(m, QuantizedSwitchLinear) for _, m in dequantized.named_modules())
    np.testing.assert_allclose(prompt_logits(dequantized, IDS), expected, atol=1e-4, rtol=1e-4)

    # Where quantized kernels run, the experts stay MXFP4 (gather_qmm, mode mxfp4).
    monkeypatch.setattr(weights, "keeps_quantized", lambda: True)
    kept = load_model(converted, mx.float32)
    modes = {m.mode for _, m in kept.named_modules() if isinstance(m, QuantizedSwitchLinear)}
    assert modes == {"mxfp4"}
    np.testing.assert_allclose(prompt_logits(kept, IDS), expected, atol=1e-4, rtol=1e-4)

    check = validate_conversion(openai_dir, converted)
    assert check.reference == "transformers (float32)" and check.passed, check


@pytest.mark.parametrize("quantize", [None, (64, 8)], ids=["float-rest", "q8-rest"])
def test_mlx_community_dir_loads_and_equals_ours(openai_dir, tmp_path, quantize) -> None:
    theirs = write_mlx_community_mxfp4(openai_dir, tmp_path / "mlx-community", quantize)
    ours = (convert_model(openai_dir, tmp_path / "ours", progress=False) if quantize is None
            else convert_model(openai_dir, tmp_path / "ours", quantize=quantize[1],
                               group_size=quantize[0], progress=False))

    assert_same_checkpoint(theirs, ours)

    their_logits = prompt_logits(load_model(theirs, mx.float32), IDS)
    np.testing.assert_array_equal(prompt_logits(load_model(ours, mx.float32), IDS), their_logits)
    if quantize is None:
        np.testing.assert_allclose(their_logits, transformers_logits(openai_dir, IDS),
                                   atol=1e-4, rtol=1e-4)


def test_openai_dir_is_converted_not_served_as_it_is(openai_dir) -> None:
    assert not loads_as_is(openai_dir)
    with pytest.raises(ValueError, match="metal-serve convert"):
        load_model(openai_dir, mx.float32)


def test_per_module_modes_are_read_as_mlx_lm_reads_them() -> None:
    config = QuantizationConfig.from_config({"quantization": {
        **MXFP4_ENTRY,
        "model.layers.0.mlp.router": {"group_size": 64, "bits": 8},  # no mode: affine
        "model.embed_tokens": {"group_size": 64, "bits": 8, "mode": "affine"},
    }})
    assert config.params_for("model.layers.0.mlp.experts.gate_proj") == MXFP4
    assert config.params_for("model.layers.0.mlp.router") == QuantParams(64, 8)
    assert config.params_for("model.embed_tokens") == QuantParams(64, 8)
    assert MXFP4.to_dict() == MXFP4_ENTRY and QuantParams(64, 8).to_dict() == {
        "group_size": 64, "bits": 8}


@pytest.mark.parametrize(("entry", "message"), [
    ({"group_size": 32, "bits": 8, "mode": "mxfp4"}, "group size 32 and 4 bits"),
    ({"group_size": 16, "bits": 4, "mode": "nvfp4"}, "mode 'nvfp4'"),
])
def test_unreadable_modes_are_refused(entry, message) -> None:
    with pytest.raises(ValueError, match=message):
        QuantizationConfig.from_config({"quantization": entry})
