"""Quantized MoE checkpoints: mlx-community's (mlx-lm's layout) load as they are and equal our
own `--quantize` output, tensor for tensor and config entry for config entry; early ones, with
each expert quantized alone under its own name, load stacked.

The mlx-lm layout is written here by hand from mlx-lm's rules: experts stacked
`[experts, out, in]` under `switch_mlp` and quantized as one tensor; every Linear, Embedding
and expert stack whose input width divides by the group size is quantized, except GLM's router
(not a Linear there); Qwen3-MoE's and GPT-OSS's routers at 8 bits (group 64), listed per module
in config.json's `quantization`, which `quantization_config` repeats.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_dirs import assert_same_checkpoint, save_mlx_dir
from tiny_models import build_tiny_model

from convert import convert_model
from convert.validate import probe_ids, prompt_logits, validate_conversion
from metal_engine.loading import weights
from metal_engine.loading.weights import load_model
from metal_engine.models.moe import QuantizedSwitchLinear

MOE_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "gpt_oss")
PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_source(request, tmp_path_factory) -> tuple[str, Path]:
    source = tmp_path_factory.mktemp(f"{request.param}-hf")
    build_tiny_model(request.param, source)
    return request.param, source


def stacked_float_tensors(source: Path) -> dict[str, mx.array]:
    """The source's tensors with each layer's per-expert projections stacked (GPT-OSS's fused
    ones split)."""
    tensors = mx.load(str(source / "model.safetensors"))
    out, experts = {}, {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"(.+)\.experts\.(\d+)\.(\w+)\.weight", name)
        if ".experts.gate_up_proj" in name or ".experts.down_proj" in name:
            out.update(split_gpt_oss_experts(name, tensor))
        elif match is None:
            out[name] = tensor
        else:
            stacked = f"{match[1]}.switch_mlp.{PROJECTIONS.get(match[3], match[3])}.weight"
            experts.setdefault(stacked, {})[int(match[2])] = tensor
    for name, by_index in experts.items():
        out[name] = mx.stack([by_index[i] for i in range(len(by_index))])
    return out


def split_gpt_oss_experts(name: str, tensor: mx.array) -> dict[str, mx.array]:
    """transformers' GPT-OSS experts, `[experts, in, out]` with gate and up interleaved in one
    tensor, as `[experts, out, in]` gate, up and down projections."""
    block = name.partition(".experts.")[0] + ".experts"
    if name.endswith("gate_up_proj"):
        fused = tensor.swapaxes(-1, -2)
        return {f"{block}.gate_proj.weight": fused[:, ::2],
                f"{block}.up_proj.weight": fused[:, 1::2]}
    if name.endswith("gate_up_proj_bias"):
        return {f"{block}.gate_proj.bias": tensor[:, ::2],
                f"{block}.up_proj.bias": tensor[:, 1::2]}
    if name.endswith("down_proj"):
        return {f"{block}.down_proj.weight": tensor.swapaxes(-1, -2)}
    return {f"{block}.down_proj.bias": tensor}


def quantized_params(model_type: str, name: str, tensor: mx.array,
                     group_size: int, bits: int) -> dict[str, int] | None:
    """mlx-lm's choice for one tensor: its params, or None where it stays float."""
    if not name.endswith(".weight") or tensor.ndim < 2 or tensor.shape[-1] % group_size:
        return None
    if model_type == "glm4_moe" and name.endswith("mlp.gate.weight"):
        return None  # GLM's router (with its correction bias) has no quantized form
    if model_type == "qwen3_moe" and name.endswith("mlp.gate.weight"):
        return {"group_size": 64, "bits": 8}
    if model_type == "gpt_oss" and name.endswith("router.weight"):
        return {"group_size": 64, "bits": 8}
    return {"group_size": group_size, "bits": bits}


def write_mlx_lm_layout(model_type: str, source: Path, out: Path, group_size: int,
                        bits: int, per_expert: bool = False) -> Path:
    """The checkpoint mlx-lm's convert (`-q --q-bits bits --q-group-size group_size`) writes;
    `per_expert`: as early mlx-community Mixtral repos hold it, each expert quantized alone."""
    out.mkdir()
    entries: dict = {"group_size": group_size, "bits": bits, "mode": "affine"}
    tensors = {}
    floats = (mx.load(str(source / "model.safetensors")) if per_expert
              else stacked_float_tensors(source))
    for name, tensor in floats.items():
        params = quantized_params(model_type, name, tensor, group_size, bits)
        if params is None:
            tensors[name] = tensor
            continue
        module = name.removesuffix(".weight")
        if params != {"group_size": group_size, "bits": bits}:
            entries[module] = params
        packed, scales, biases = mx.quantize(tensor, params["group_size"], params["bits"])
        tensors.update({name: packed, f"{module}.scales": scales, f"{module}.biases": biases})
    return save_mlx_dir(out, source, tensors, entries)


@pytest.mark.parametrize("group_size", [64, 32])
def test_mlx_community_moe_checkpoint_loads_and_equals_our_quantize(moe_source, tmp_path,
                                                                    group_size) -> None:
    model_type, source = moe_source
    theirs = write_mlx_lm_layout(model_type, source, tmp_path / "mlx-lm", group_size, 4)
    ours = convert_model(source, tmp_path / "ours", quantize=4, group_size=group_size,
                         progress=False)

    their_tensors = assert_same_checkpoint(theirs, ours)
    assert any(n.endswith(".scales") and t.ndim == 3 for n, t in their_tensors.items())

    ids = probe_ids(128) * 5  # 40 tokens: the gathered matmuls sort by expert
    their_logits = prompt_logits(load_model(theirs, mx.float32), ids)
    np.testing.assert_array_equal(prompt_logits(load_model(ours, mx.float32), ids), their_logits)
    check = validate_conversion(source, ours)  # 4 bits stays near the float source
    assert check.reference == "the source in float32" and check.passed, check
    assert check.relative_error > 0  # and was quantized


# GPT-OSS checkpoints were never stored one tensor per expert.
@pytest.mark.parametrize("moe_source", ["qwen3_moe", "mixtral", "glm4_moe"], indirect=True)
def test_early_per_expert_checkpoint_loads_stacked(moe_source, tmp_path) -> None:
    model_type, source = moe_source
    stacked = write_mlx_lm_layout(model_type, source, tmp_path / "stacked", 32, 4)
    early = write_mlx_lm_layout(model_type, source, tmp_path / "early", 32, 4, per_expert=True)
    assert any(".experts.0." in n for n in mx.load(str(early / "model.safetensors")))
    ids = probe_ids(128) * 5
    np.testing.assert_array_equal(prompt_logits(load_model(early, mx.float32), ids),
                                  prompt_logits(load_model(stacked, mx.float32), ids))


@pytest.mark.parametrize(("model_type", "router"), [
    ("qwen3_moe", "mlp.gate"), ("gpt_oss", "mlp.router"), ("gemma4_text", "router.proj")])
def test_routers_are_kept_at_8_bits(tmp_path, model_type, router) -> None:
    """As mlx-lm's quant_predicate of each family says; the rest at the asked 4 bits."""
    source = tmp_path / "hf"
    build_tiny_model(model_type, source)
    out = convert_model(source, tmp_path / "q4", quantize=4, progress=False)
    config = json.loads((out / "config.json").read_text())
    stored = mx.load(str(out / "model.safetensors"))
    routers = {n.removesuffix(".weight") for n in stored if n.endswith(f"{router}.weight")}
    assert routers
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine",
                                      **dict.fromkeys(routers, {"group_size": 64, "bits": 8})}
    for name in routers:
        assert stored[f"{name}.weight"].shape[-1] == 64 * 8 // 32  # 8-bit packing
    up = next(n for n, t in stored.items() if n.endswith("up_proj.weight") and t.ndim == 3)
    assert stored[up].shape[-1] == 64 * 4 // 32


def test_dense_layers_whose_width_misses_the_group_stay_float(tmp_path) -> None:
    source = tmp_path / "hf"
    build_tiny_model("qwen3_moe", source)
    out = convert_model(source, tmp_path / "q4", quantize=4, progress=False)
    stored = mx.load(str(out / "model.safetensors"))
    assert "model.layers.1.mlp.down_proj.scales" not in stored  # the dense layer: 96 % 64
    assert "model.layers.1.mlp.up_proj.scales" in stored


def test_quantized_moe_runs_quantized_or_dequantized(moe_source, tmp_path, monkeypatch) -> None:
    """On the CPU the experts are dequantized at load; where quantized kernels run they stay
    QuantizedSwitchLinear (gather_qmm), forced here on the CPU: both give the same logits."""
    model_type, source = moe_source
    out = convert_model(source, tmp_path / "q8", quantize=8, group_size=32, progress=False)
    ids = probe_ids(128) * 5
    dequantized_model = load_model(out, mx.float32)
    assert not any(isinstance(m, QuantizedSwitchLinear)
                   for _, m in dequantized_model.named_modules())
    dequantized = prompt_logits(dequantized_model, ids)

    monkeypatch.setattr(weights, "keeps_quantized", lambda: True)
    model = load_model(out, mx.float32)
    kept = [p for p, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    stored = mx.load(str(out / "model.safetensors"))
    assert kept and len(kept) == sum(n.endswith(".scales") and t.ndim == 3
                                     for n, t in stored.items())
    np.testing.assert_allclose(prompt_logits(model, ids), dequantized, atol=1e-4, rtol=1e-4)
