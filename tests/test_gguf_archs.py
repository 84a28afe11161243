"""GGUF input beyond the default model: every architecture the converter reads, written by the
tests with `gguf.GGUFWriter` as llama.cpp lays it out, with K-quant (Q4_K, Q5_K, Q6_K), Q8_0
and float tensors. Conversion must give the dequantized tensors under Hugging Face names (Q/K
rows un-permuted for llama, Gemma's `+1` norm offset taken off) and the config the metadata
describes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf_files import copy_tokenizer_metadata, finish, llama_cpp_permute, stored_tensor
from safetensors.numpy import load_file

from convert import convert_model
from convert.validate import validate_conversion

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2, 256, 4, 2, 64, 256, 400
# Storage type per projection: the three K-quants, Q8_0 and a float type all appear.
PROJECTIONS = {
    "attn_q": ("self_attn.q_proj", (HEADS * HEAD_DIM, HIDDEN), Q.Q4_K),
    "attn_k": ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q5_K),
    "attn_v": ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q6_K),
    "attn_output": ("self_attn.o_proj", (HIDDEN, HEADS * HEAD_DIM), Q.Q8_0),
    "ffn_gate": ("mlp.gate_proj", (FFN, HIDDEN), Q.Q4_K),
    "ffn_up": ("mlp.up_proj", (FFN, HIDDEN), Q.F16),
    "ffn_down": ("mlp.down_proj", (HIDDEN, FFN), Q.Q6_K),
}
PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
SANDWICH_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                  "ffn_norm": "pre_feedforward_layernorm",
                  "post_ffw_norm": "post_feedforward_layernorm"}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# GGUF architecture -> (model_type, norms per block, untied output, config keys to expect)
ARCHS = {
    "llama": ("llama", PRE_NORMS, True, {"sliding_window": None}),
    "qwen2": ("qwen2", PRE_NORMS, True, {"attention_bias": True}),
    "qwen3": ("qwen3", {**PRE_NORMS, **QK_NORMS}, False, {"head_dim": HEAD_DIM}),
    "gemma2": ("gemma2", SANDWICH_NORMS, False, {
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 128,
        "query_pre_attn_scalar": HEAD_DIM,
        "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3": ("gemma3_text", {**SANDWICH_NORMS, **QK_NORMS}, False, {
        "sliding_window": 128, "rope_local_base_freq": 10000.0, "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "layer_types": ["sliding_attention", "full_attention"]}),
}


def _add_metadata(writer: GGUFWriter, arch: str) -> None:
    writer.add_block_count(LAYERS)
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    if arch.startswith("gemma"):
        writer.add_sliding_window(128)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    if arch == "gemma3":
        writer.add_sliding_window_pattern([True, False])
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(8.0)
    copy_tokenizer_metadata(writer, VOCAB)


def write_arch_gguf(path: Path, arch: str,
                    rope_freqs: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A tiny GGUF of `arch`; returns the float32 tensors (HF names) conversion must give."""
    _, norms, untied, _ = ARCHS[arch]
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, arch)
    _add_metadata(writer, arch)
    norm_offset = np.float32(1.0) if arch.startswith("gemma") else np.float32(0.0)
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], qtype: Q, heads: int = 0):
        data, raw_type, reference = stored_tensor(rng, shape, qtype)
        if heads and arch == "llama":  # llama.cpp permutes q/k rows for llama only
            data = llama_cpp_permute(data, heads)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_type)
        expected[hf_name] = reference

    def add_norm(gguf_name: str, hf_name: str, size: int):
        weights = rng.standard_normal(size).astype(np.float32)
        writer.add_tensor(gguf_name, weights + norm_offset)  # as llama.cpp stores Gemma's
        expected[hf_name] = weights + norm_offset - norm_offset

    add("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN), Q.Q8_0)
    heads = {"attn_q": HEADS, "attn_k": KV_HEADS}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        for short, (name, shape, qtype) in PROJECTIONS.items():
            add(f"blk.{i}.{short}.weight", f"{prefix}{name}.weight", shape, qtype,
                heads.get(short, 0))
        if arch == "qwen2":
            for short in ("attn_q", "attn_k", "attn_v"):
                name, shape, _ = PROJECTIONS[short]
                add(f"blk.{i}.{short}.bias", f"{prefix}{name}.bias", shape[:1], Q.F32)
        for short, name in norms.items():
            size = HEAD_DIM if short in QK_NORMS else HIDDEN
            add_norm(f"blk.{i}.{short}.weight", f"{prefix}{name}.weight", size)
    add_norm("output_norm.weight", "model.norm.weight", HIDDEN)
    if untied:
        add("output.weight", "lm_head.weight", (VOCAB, HIDDEN), Q.Q6_K)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    finish(writer)
    return expected


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_arch_converts_to_dequantized_reference(arch: str, tmp_path: Path) -> None:
    path = tmp_path / f"{arch}.gguf"
    expected = write_arch_gguf(path, arch)
    out = convert_model(path, tmp_path / "out", progress=False)

    got = load_file(out / "model.safetensors")
    assert set(got) == set(expected)
    for name, reference in expected.items():
        np.testing.assert_array_equal(got[name], reference, err_msg=name)
    model_type, _, untied, keys = ARCHS[arch]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type
    assert config["tie_word_embeddings"] is not untied
    assert (config["num_key_value_heads"], config["head_dim"]) == (KV_HEADS, HEAD_DIM)
    for key, value in keys.items():
        assert config.get(key) == value, key
    # Loads in the engine, and its logits equal the source's run in float32.
    assert validate_conversion(path, out).relative_error == 0.0


def test_gguf_k_quants_quantize_to_mlx_on_the_way(tmp_path: Path) -> None:
    path = tmp_path / "qwen3.gguf"
    write_arch_gguf(path, "qwen3")
    out = convert_model(path, tmp_path / "out", progress=False, quantize=8, group_size=64)

    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    check = validate_conversion(path, out)
    assert check.reference == "the source in float32" and check.passed, check


def test_gemma1_and_unknown_archs_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    writer = GGUFWriter(path, "gemma")
    writer.add_block_count(1)
    finish(writer)
    with pytest.raises(ValueError, match="'gemma' is not supported.*gemma2, gemma3"):
        convert_model(path, tmp_path / "out")


def llama_cpp_rope_factors(theta: float, factor: float, low: float, high: float,
                           original: int) -> np.ndarray:
    """The divisors llama.cpp's converter writes as rope_freqs.weight for Llama 3 rope scaling."""
    freqs = 1.0 / theta ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM)
    wavelength = 2 * np.pi / freqs
    smooth = (original / wavelength - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelength > original / low, factor, blended)
    return np.where(wavelength < original / high, 1.0, factors).astype(np.float32)


def test_llama3_rope_freqs_become_llama3_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "llama3.gguf"
    write_arch_gguf(path, "llama", rope_freqs=llama_cpp_rope_factors(10000.0, 32.0, 1.0, 4.0, 8192))
    out = convert_model(path, tmp_path / "out", progress=False)

    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in load_file(out / "model.safetensors")
