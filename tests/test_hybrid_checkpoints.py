"""Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints as they are published compute what the tiny
transformers model they are made from computes here:

- mlx-community's dirs (mlx-lm's layout, float or quantized; see tests/mlx_dirs.py) load as
  they are, and the float ones convert;
- the multi-token-prediction head (`mtp.*`, which transformers drops on load) survives
  conversion, stacked as the decoder layers' experts are and never quantized, and loading
  ignores it; Qwen3.5-MoE's fused experts (as published) convert;
- llama.cpp's GGUFs (qwen35, qwen35moe, qwen3next; see tests/gguf_files.py) convert.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from gguf_files import write_hybrid_gguf
from mlx_dirs import write_mlx_lm_hybrid
from safetensors.numpy import load_file, save_file
from tiny_models import COMMON, TINY_MODELS, VOCAB, build_tiny_model
from tokenizers import Tokenizer, models

from convert import convert_model
from convert.model_ref import loads_as_is
from convert.validate import prompt_logits
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.quantization import QuantizationConfig
from metal_engine.loading.weights import load_model, this_layout_entries

IDS = [5, 9, 3, 77, 12, 40, 41, 8, 9, 100, 2, 6, 17, 90, 33, 4]
# Multimodal wrappers of the tiny text configs: (wrapper config, vision config, model class).
MULTIMODAL = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5VisionConfig", "Qwen3_5ForConditionalGeneration",
                "qwen3_5_text"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeVisionConfig",
                    "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"),
}


def build(kind: str, path: Path, **overrides):
    """A tiny random checkpoint in `path` and its float32 PyTorch model: a multimodal
    wrapper (`qwen3_5`, `qwen3_5_moe`) or a text model (a tiny_models type, with
    `overrides` on its config)."""
    if kind not in MULTIMODAL and not overrides:
        return build_tiny_model(kind, path)
    torch.manual_seed(0)
    if kind in MULTIMODAL:
        config_class, vision_class, model_class, text_type = MULTIMODAL[kind]
        text = getattr(transformers, TINY_MODELS[text_type][0])(
            **{**COMMON, **TINY_MODELS[text_type][2]})
        vision = getattr(transformers, vision_class)(depth=1, hidden_size=32, num_heads=2,
                                                     intermediate_size=64, out_hidden_size=64)
        config = getattr(transformers, config_class)(text_config=text.to_dict(),
                                                     vision_config=vision.to_dict())
    else:
        config_class, model_class, base = TINY_MODELS[kind]
        config = getattr(transformers, config_class)(**{**COMMON, **base, **overrides})
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # norms off 1 and 0, as build_tiny_model moves them
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(path / "tokenizer.json"))
    return model


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float().numpy()


def logits(model_dir: Path) -> np.ndarray:
    return prompt_logits(load_model(model_dir, mx.float32), IDS)


def assert_same_tensors(got_dir: Path, want_dir: Path) -> None:
    """Same names; values equal but for float32 rounding (of a norm's +1 and -1, or of
    exp and log)."""
    got, want = (load_file(d / "model.safetensors") for d in (got_dir, want_dir))
    assert set(got) == set(want)
    for name, tensor in want.items():
        np.testing.assert_allclose(got[name], tensor, atol=1e-6, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_mlx_lm_float_dir_loads_and_converts(kind: str, tmp_path: Path) -> None:
    """mlx-lm's layout (conv `[C, K, 1]`, norms with the 1 added, `language_model.` names,
    Qwen3-Next's projections fused) loads as it is and converts to Hugging Face's."""
    model = build(kind, tmp_path / "hf")
    theirs = write_mlx_lm_hybrid(tmp_path / "hf", tmp_path / "mlx-lm")
    assert any(n.startswith("language_model.") for n in mx.load(str(theirs / "model.safetensors"))
               ) == (kind == "qwen3_5")  # fmt: skip
    expected = torch_logits(model)
    np.testing.assert_allclose(logits(theirs), expected, atol=1e-4, rtol=1e-4)
    assert loads_as_is(theirs) == (kind == "qwen3_5")  # a MoE dir is converted to stack experts

    converted = convert_model(theirs, tmp_path / "out", progress=False)
    assert_same_tensors(converted, convert_model(tmp_path / "hf", tmp_path / "ref",
                                                 progress=False, text_only=True))  # as mlx-lm
    np.testing.assert_allclose(logits(converted), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_mlx_lm_quantized_dir_loads_as_our_quantize(kind: str, tmp_path: Path) -> None:
    """A quantized mlx-community dir loads as it is and computes what our `--quantize` of the
    same checkpoint computes: same packed weights (Qwen3-Next's fused rows split), the routers
    and shared-expert gates at 8 bits on both sides."""
    build(kind, tmp_path / "hf")
    theirs = write_mlx_lm_hybrid(tmp_path / "hf", tmp_path / "mlx-lm", bits=4, group_size=32)
    ours = convert_model(tmp_path / "hf", tmp_path / "ours", quantize=4, group_size=32,
                         progress=False)
    assert loads_as_is(theirs)

    their_config, our_config = (json.loads((d / "config.json").read_text())
                                for d in (theirs, ours))
    their_entries = this_layout_entries(QuantizationConfig.from_config(their_config),
                                        multimodal=kind in MULTIMODAL)
    assert their_entries == QuantizationConfig.from_config(our_config)
    assert bool(their_entries.modules) == (kind != "qwen3_5")  # the MoE families' 8-bit gates
    np.testing.assert_allclose(logits(theirs), logits(ours), atol=1e-5, rtol=1e-5)


def with_mtp(hf: dict[str, np.ndarray], layer: int, prefix: str,
             fused_experts: bool) -> dict[str, np.ndarray]:
    """A multi-token-prediction head as Qwen3.5/3.6 publish it: a full-attention decoder layer
    (a copy of `layer`, its experts one tensor each, or fused as Qwen3.6's) and its input
    projection and norms."""
    rng = np.random.default_rng(3)
    source = f"{prefix}layers.{layer}."
    mtp = {"mtp.layers.0." + n.removeprefix(source): t + 0.01 * rng.standard_normal(t.shape,
                                                                                    np.float32)
           for n, t in hf.items() if n.startswith(source)}
    hidden = hf[f"{source}input_layernorm.weight"].shape[0]
    mtp["mtp.fc.weight"] = rng.standard_normal((hidden, 2 * hidden), np.float32)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = rng.standard_normal(hidden, np.float32)
    return fuse_experts(mtp) if fused_experts else mtp


def fuse_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert tensors as Qwen3.5-MoE's published checkpoints hold them: `experts.gate_up_proj
    [E, 2I, H]` (gate rows first) and `experts.down_proj [E, H, I]`, no `.weight`."""
    out, sets = {}, {}
    for name, tensor in tensors.items():
        block, sep, rest = name.partition(".experts.")
        if not sep:
            out[name] = tensor
            continue
        expert, proj = rest.split(".")[:2]
        sets.setdefault((block, proj), {})[int(expert)] = tensor
    for block in {b for b, _ in sets}:
        stack = {p: np.stack([e[i] for i in range(len(e))]) for (b, p), e in sets.items()
                 if b == block}
        out[f"{block}.experts.gate_up_proj"] = np.concatenate(
            [stack["gate_proj"], stack["up_proj"]], axis=1)
        out[f"{block}.experts.down_proj"] = stack["down_proj"]
    return out


def stacked(tensors: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The `switch_mlp` stacks of the experts under `prefix` (per-expert or fused)."""
    fused = tensors.get(f"{prefix}experts.gate_up_proj")
    if fused is not None:
        gate, up = np.split(fused, 2, axis=1)
        down = tensors[f"{prefix}experts.down_proj"]
        return dict(zip(("gate_proj", "up_proj", "down_proj"), (gate, up, down), strict=True))
    experts = sorted({n.split(".")[-3] for n in tensors if n.startswith(f"{prefix}experts.")},
                     key=int)
    return {p: np.stack([tensors[f"{prefix}experts.{e}.{p}.weight"] for e in experts])
            for p in ("gate_proj", "up_proj", "down_proj")}


# (kind, the main layers' experts fused, the head's fused): Qwen3.5-MoE as published (fused
# layers, per-expert head), Qwen3.6 (both fused), Qwen3-Next (both per expert).
MTP_CHECKPOINTS = [("qwen3_5_moe", True, False), ("qwen3_5_moe", True, True),
                   ("qwen3_next", False, False)]


@pytest.mark.parametrize(("kind", "fused_layers", "fused_mtp"), MTP_CHECKPOINTS)
def test_mtp_head_is_kept_and_ignored_at_load(kind, fused_layers, fused_mtp,
                                              tmp_path: Path) -> None:
    source = tmp_path / "hf"
    model = build(kind, source)
    prefix = "model.language_model." if kind in MULTIMODAL else "model."
    hf = load_file(source / "model.safetensors")
    mtp = with_mtp(hf, layer=1, prefix=prefix, fused_experts=fused_mtp)
    save_file({**(fuse_experts(hf) if fused_layers else hf), **mtp},
              str(source / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config.get("text_config", config)["mtp_num_hidden_layers"] = 1
    (source / "config.json").write_text(json.dumps(config))
    expected = torch_logits(model)
    if fused_layers:  # transformers reads the fused layout to the same model
        reloaded = type(model).from_pretrained(source).eval()
        np.testing.assert_allclose(torch_logits(reloaded), expected, atol=1e-6)

    out = convert_model(source, tmp_path / "out", progress=False)
    got = load_file(out / "model.safetensors")
    head = {n: t for n, t in got.items() if n.startswith("mtp.")}
    switch = stacked(mtp, "mtp.layers.0.mlp.")
    assert set(head) == ({n for n in mtp if ".experts." not in n}
                         | {f"mtp.layers.0.mlp.switch_mlp.{p}.weight" for p in switch})
    for name, tensor in mtp.items():
        if ".experts." not in name:
            np.testing.assert_array_equal(head[name], tensor, err_msg=name)
    for proj, tensor in switch.items():
        np.testing.assert_array_equal(head[f"mtp.layers.0.mlp.switch_mlp.{proj}.weight"], tensor)
    assert json.loads((out / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    np.testing.assert_allclose(logits(out), expected, atol=1e-4, rtol=1e-4)

    quantized = convert_model(source, tmp_path / "q4", quantize=4, group_size=32,
                              progress=False)
    q_tensors = mx.load(str(quantized / "model.safetensors"))
    assert any(n.endswith(".scales") for n in q_tensors)
    q_head = {n: t for n, t in q_tensors.items() if n.startswith("mtp.")}
    assert set(q_head) == set(head) and all(t.dtype == mx.float32 for t in q_head.values())
    assert np.isfinite(logits(quantized)).all()


def test_a_published_dense_multimodal_dir_loads_as_it_is(tmp_path: Path) -> None:
    """Qwen3.5 as published (a multimodal wrapper, vision tower and multi-token-prediction head
    beside the text model) loads without conversion: only the text model is read."""
    source = tmp_path / "hf"
    model = build("qwen3_5", source)
    hf = load_file(source / "model.safetensors")
    assert any(n.startswith("model.visual.") for n in hf)
    mtp = with_mtp(hf, layer=1, prefix="model.language_model.", fused_experts=False)
    save_file({**hf, **mtp}, str(source / "model.safetensors"), metadata={"format": "pt"})
    assert loads_as_is(source)
    np.testing.assert_allclose(logits(source), torch_logits(model), atol=1e-4, rtol=1e-4)


# llama.cpp's qwen3next has no dense FFN tensors: its Qwen3-Next has experts in every layer.
GGUF_MODELS = [("qwen3_5_text", {}, 0), ("qwen3_5_moe_text", {}, 1),
               ("qwen3_next", {"mlp_only_layers": []}, 0)]


@pytest.mark.parametrize(("model_type", "overrides", "mtp_layers"), GGUF_MODELS)
def test_hybrid_gguf_converts_to_the_hf_model(model_type, overrides, mtp_layers,
                                              tmp_path: Path) -> None:
    """The GGUF's tensors come back as the checkpoint's (A from -exp(A_log), the conv
    unsqueezed, the norms' 1 taken off, Qwen3.5's value heads back in grouped order,
    Qwen3-Next's `ssm_ba` split); its multi-token-prediction block is left out."""
    model = build(model_type, tmp_path / "hf", **overrides)
    path = write_hybrid_gguf(tmp_path / "hf", tmp_path / "model.gguf", mtp_layers)
    out = convert_model(path, tmp_path / "out", progress=False)
    reference = convert_model(tmp_path / "hf", tmp_path / "ref", progress=False)

    assert_same_tensors(out, reference)  # and no multi-token-prediction tensors
    ours = ModelConfig.from_dict(json.loads((out / "config.json").read_text()))
    theirs = ModelConfig.from_dict(json.loads((reference / "config.json").read_text()))
    # The GGUF's tokenizer (borrowed from the default model) names its own special tokens.
    assert dataclasses.replace(ours, bos_token_id=theirs.bos_token_id,
                               eos_token_ids=theirs.eos_token_ids) == theirs
    np.testing.assert_allclose(logits(out), torch_logits(model), atol=1e-4, rtol=1e-4)
