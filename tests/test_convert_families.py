"""Every supported family through `convert`: its Hugging Face tensors come out under this
layout's names (MoE experts stacked, fused projections split, both rope keys written), and a
multimodal checkpoint converts to its text model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import tiny_models
import torch
import transformers
from hf_configs import assert_transformers_reads_the_same_rope
from safetensors.numpy import load_file
from tiny_models import COMMON, TINY_MODELS, build_tiny_model

from convert import convert_model
from convert.expert_stacking import FUSED_LAYOUTS, stack_experts
from convert.validate import prompt_logits
from metal_engine.loading.families import ROPE_PER_LAYER_TYPE
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.text_part import TEXT_PARTS, text_part_config
from metal_engine.loading.weights import load_model, text_model_name


def _hf_tensors(path: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("model_type", list(TINY_MODELS))
def test_every_family_converts_with_both_rope_keys(model_type: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    source = tmp_path / "hf"
    model = build_tiny_model(model_type, source)
    out = convert_model(source, tmp_path / "out", progress=False, text_only=True)

    source_tensors = _hf_tensors(source)
    source_config = json.loads((source / "config.json").read_text())
    if source_config["model_type"] in TEXT_PARTS:  # saved in its multimodal model: the text part
        source_tensors = {text: tensor for name, tensor in source_tensors.items()
                          if (text := text_model_name(name)) is not None}
        source_config = text_part_config(source_config)
    expected = _stacked_experts(source_tensors, model_type)
    if model_type == "qwen3_next":
        expected = _unfused(expected, source_config)
    got = _hf_tensors(out)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        np.testing.assert_array_equal(got[name], tensor, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert "rope_theta" not in source_config and "rope_parameters" in config
    if model_type in ROPE_PER_LAYER_TYPE:
        assert config["rope_theta"] == config["rope_parameters"]["full_attention"]["rope_theta"]
        assert (config["rope_local_base_freq"]
                == config["rope_parameters"]["sliding_attention"]["rope_theta"])
    else:
        assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
        kind = source_config["rope_parameters"]["rope_type"]
        assert (config.get("rope_scaling") or {"rope_type": "default"})["rope_type"] == kind
    assert ModelConfig.from_dict(config) == ModelConfig.from_dict(source_config)
    assert_transformers_reads_the_same_rope(out, source)
    if expected.keys() != _hf_tensors(source).keys():
        return  # stacked experts are mlx-lm's layout, which transformers does not read
    ids = torch.tensor([[5, 9, 3, 77, 12, 40, 41, 8, 9, 100, 2, 6]])
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def _stacked_experts(tensors: dict[str, np.ndarray], model_type: str) -> dict[str, np.ndarray]:
    """Per-expert tensors (`...experts.E.w1.weight`, `...experts.E.gate_proj.weight`) stacked
    into `...switch_mlp.gate_proj.weight [experts, out, in]`, Laguna's router bias (stored
    beside its experts) under its router; the rest as they are."""
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in tensors.items():
        name = name.replace(".experts.e_score_correction_bias", ".gate.e_score_correction_bias")
        match = re.fullmatch(r"(.+)\.experts\.(\d+)\.(\w+)\.weight", name)
        fused = re.fullmatch(r"(.+)\.experts\.(gate_up_proj|down_proj)(_bias)?", name)
        if fused is not None:
            module = FUSED_LAYOUTS[model_type].module
            split = _split_gpt_oss if model_type == "gpt_oss" else _split_gemma4
            out.update(split(f"{fused[1]}.{module}", fused[2], fused[3] is not None, tensor))
            continue
        if match is None:
            out[name] = tensor
            continue
        stacked = f"{match[1]}.switch_mlp.{names.get(match[3], match[3])}.weight"
        experts.setdefault(stacked, {})[int(match[2])] = tensor
    for name, by_index in experts.items():
        out[name] = np.stack([by_index[i] for i in range(len(by_index))])
    return out


def _unfused(tensors: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """Qwen3-Next's fused projections as Qwen3.5's: per key head its q, k, then its value
    heads' v and z rows (b then a in in_proj_ba)."""
    heads, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    dv = config["linear_num_value_heads"] // heads * config["linear_value_head_dim"]
    out = {}
    for name, tensor in tensors.items():
        prefix = name.removesuffix("in_proj_qkvz.weight").removesuffix("in_proj_ba.weight")
        if name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
            grouped = tensor.reshape(heads, -1, tensor.shape[-1])
        if name.endswith("in_proj_qkvz.weight"):
            q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + dv], axis=1)
            rows = [x.reshape(-1, tensor.shape[-1]) for x in (q, k, v, z)]
            out[prefix + "in_proj_qkv.weight"] = np.concatenate(rows[:3])
            out[prefix + "in_proj_z.weight"] = rows[3]
        elif name.endswith("in_proj_ba.weight"):
            b, a = np.split(grouped, 2, axis=1)
            out[prefix + "in_proj_b.weight"] = b.reshape(-1, tensor.shape[-1])
            out[prefix + "in_proj_a.weight"] = a.reshape(-1, tensor.shape[-1])
        else:
            out[name] = tensor
    return out


def _split_gemma4(prefix: str, kind: str, bias: bool, tensor: np.ndarray) -> dict:
    """Gemma 4 (and Mistral 4): [experts, out, in], gate rows then up rows; no biases."""
    if kind == "down_proj":
        return {f"{prefix}.down_proj.weight": tensor}
    gate, up = np.split(tensor, 2, axis=1)
    return {f"{prefix}.gate_proj.weight": gate, f"{prefix}.up_proj.weight": up}


def _split_gpt_oss(prefix: str, kind: str, bias: bool, tensor: np.ndarray) -> dict:
    """GPT-OSS: [experts, in, out], gate and up columns interleaved."""
    if kind == "down_proj":
        return {f"{prefix}.down_proj.bias": tensor} if bias else {
            f"{prefix}.down_proj.weight": tensor.transpose(0, 2, 1)}
    if bias:
        return {f"{prefix}.gate_proj.bias": tensor[:, 0::2],
                f"{prefix}.up_proj.bias": tensor[:, 1::2]}
    return {f"{prefix}.gate_proj.weight": tensor[:, :, 0::2].transpose(0, 2, 1),
            f"{prefix}.up_proj.weight": tensor[:, :, 1::2].transpose(0, 2, 1)}


def _gemma4_multimodal():
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=2, head_dim=16)
    text = transformers.Gemma4TextConfig(**{**COMMON, **TINY_MODELS["gemma4_text"][2]})
    config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       audio_config=None)
    return transformers.Gemma4ForConditionalGeneration(config)


def _qwen3_5_multimodal():
    vision = transformers.Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64,
                                              num_heads=2, out_hidden_size=64)
    text = transformers.Qwen3_5TextConfig(**{**COMMON, **TINY_MODELS["qwen3_5_text"][2]})
    config = transformers.Qwen3_5Config(text_config=text.to_dict(),
                                        vision_config=vision.to_dict())
    return transformers.Qwen3_5ForConditionalGeneration(config)


def _kimi_k25_multimodal():
    """Kimi K2.5: Kimi K2's DeepSeek V3 text model (its lm_head its own) beside a vision
    tower, which transformers saves under `language_model.model.blocks.`."""
    vision = transformers.Kimi_K25VisionConfig(hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2,
                                               pos_emb_height=4, pos_emb_width=4,
                                               pos_emb_time=2)
    text = transformers.DeepseekV3Config(**{**COMMON, **TINY_MODELS["deepseek_v3"][2]})
    config = transformers.Kimi_K25Config(text_config=text.to_dict(),
                                         vision_config=vision.to_dict(),
                                         projection_hidden_size=32, tie_word_embeddings=False)
    config._attn_implementation = COMMON["attn_implementation"]
    return transformers.Kimi_K25ForConditionalGeneration(config)


@pytest.mark.parametrize(("build", "text_type"), [(_gemma4_multimodal, "gemma4_text"),
                                                  (_qwen3_5_multimodal, "qwen3_5_text"),
                                                  (_kimi_k25_multimodal, "deepseek_v3")])
def test_a_multimodal_checkpoint_converts_to_its_text_model(build, text_type,
                                                            tmp_path: Path) -> None:
    """Gemma 4's, Qwen3.5's and Kimi K2.5's published checkpoints are multimodal: the text
    model's weights sit under `model.language_model.` (Kimi's under `language_model.`),
    beside vision towers a text-only conversion leaves out (tests/test_qwen_vision.py: Qwen's
    kept by default)."""
    torch.manual_seed(0)
    model = build().eval()
    model.save_pretrained(tmp_path / "hf")
    tiny_models.save_word_tokenizer(tmp_path / "hf")
    out = convert_model(tmp_path / "hf", tmp_path / "out", progress=False, text_only=True)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == text_type and "vision_config" not in written
    assert_transformers_reads_the_same_rope(out, tmp_path / "hf")
    assert all(name.startswith(("model.layers.", "model.embed", "model.norm", "model.per_layer",
                                "lm_head.")) for name in _hf_tensors(out))  # fmt: skip
    ids = [5, 9, 3, 77, 12, 40, 41, 8, 9, 100, 2, 6]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    got = prompt_logits(load_model(out, mx.float32), ids)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_qwen3_vl_moe_experts_split_from_either_stored_layout() -> None:
    """Published Qwen3-VL-MoE checkpoints store fused experts `[experts, in, out]`,
    transformers saves them `[experts, out, in]`: each splits into the same projections."""
    config = ModelConfig.from_dict(dict(
        model_type="qwen3_vl_moe_text", vocab_size=128, hidden_size=64, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48))
    rng = np.random.default_rng(0)
    gate, up = rng.standard_normal((2, 4, 48, 64)).astype(np.float32)  # [experts, out, in]
    down = rng.standard_normal((4, 64, 48)).astype(np.float32)
    saved = {"l.mlp.experts.gate_up_proj": np.concatenate([gate, up], axis=1),
             "l.mlp.experts.down_proj": down}
    published = {name: tensor.transpose(0, 2, 1) for name, tensor in saved.items()}
    expected = {"l.mlp.switch_mlp.gate_proj.weight": gate, "l.mlp.switch_mlp.up_proj.weight": up,
                "l.mlp.switch_mlp.down_proj.weight": down}
    for stored in (saved, published):
        got = dict(stack_experts(config, iter((n, mx.array(t)) for n, t in stored.items())))
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            np.testing.assert_array_equal(np.array(got[name]), tensor, err_msg=name)


def test_a_checkpoint_missing_an_expert_is_refused_by_name(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    build_tiny_model("qwen3_moe", tmp_path / "hf")
    tensors = _hf_tensors(tmp_path / "hf")
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.switch_mlp\.up_proj.*missing \[3\]"):
        convert_model(tmp_path / "hf", tmp_path / "out", progress=False)


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma4_text", "mistral4"])
def test_fused_experts_are_served_after_convert_and_refused_before_it(model_type: str,
                                                                      tmp_path: Path) -> None:
    """transformers saves these families' experts fused; served as saved, the loader names
    the command that splits them instead of MLX's list of unknown parameters."""
    build_tiny_model(model_type, tmp_path / "hf")
    with pytest.raises(ValueError, match=r"experts fused .*metal-serve convert .* --out DIR"):
        load_model(tmp_path / "hf", mx.float32)
    converted = convert_model(tmp_path / "hf", tmp_path / "out", progress=False)
    assert load_model(converted, mx.float32).config.model_type == model_type
