"""deepseek2 GGUFs (DeepSeek V3 / R1, Kimi K2 and GLM-4.7-Flash as llama.cpp writes them)
convert to deepseek_v3 / glm4_moe_lite and compute what the Hugging Face model they came from
computes.

Each GGUF is written here from a tiny random transformers checkpoint the way llama.cpp's
converter writes it (conversion/deepseek.py DeepseekV2Model, glm.py Glm4MoeLiteModel): gguf-py's
tensor names; each layer's experts stacked; `kv_b_proj` split per head into `attn_k_b`
(transposed) and `attn_v_b`, or kept whole as `attn_kv_b` (the layout of files written before
that split, which llama.cpp still reads); the correction bias as `exp_probs_b.bias`; the
metadata its `set_gguf_parameters` writes (one KV head of the absorbed width, the per-head
sizes as `*_length_mla`, YaRN's mscale_all_dim times 0.1, no gating function where the config
names none, as GLM-4.7-Flash's does not); GLM-4.7-Flash's multi-token-prediction block; and the
storage types of its `--outtype f32` and `q8_0` (norms, router and biases in F32, a tensor
whose rows Q8_0 cannot block in F16). The reference is that checkpoint with each tensor rounded
as the file stores it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from conversion_checks import assert_converts_to
from gguf import ExpertGatingFuncType, GGUFWriter, RopeScalingType
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_files import TEMPLATE, copy_tokenizer_metadata, finish
from safetensors.numpy import load_file, save_file
from tiny_models import VOCAB, build_tiny_model

from convert import convert_model
from metal_engine.loading.tokenizer_loading import load_tokenizer

EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
KV_B = re.compile(r"(model\.layers\.\d+\.self_attn\.)kv_b_proj\.weight")
BIAS = "e_score_correction_bias"
# (model_type, --outtype, kv_b layout, tokenizer.ggml.pre, config fields over the tiny family's)
CASES = {
    "deepseek_v3-f32": ("deepseek_v3", "f32", "split", "deepseek-v3", {}),
    # Kimi K2's files: DeepSeek V3's architecture and a pre-tokenizer of their own. 32-wide
    # nope rows: each head's attn_k_b rows block as Q8_0 too.
    "kimi_k2-q8_0": ("deepseek_v3", "q8_0", "split", "kimi-k2", {"qk_nope_head_dim": 32}),
    "deepseek_v3-q8_0-unsplit": ("deepseek_v3", "q8_0", "whole", "deepseek-v3", {}),
    # llama.cpp supports leading dense layers only, as the released GLM-4.7-Flash has them.
    "glm4_moe_lite-q8_0": ("glm4_moe_lite", "q8_0", "split", "glm4", {
        "mlp_layer_types": ["dense", "sparse", "sparse"], "first_k_dense_replace": 1}),
}
# How each file's pre-tokenizer splits a probe before BPE (llama.cpp's regexes, as the models'
# tokenizer.json files have them): digits in runs of 3 (not GPT-2's whole runs); DeepSeek V3
# keeps a CJK and kana run apart from the space before it; Kimi K2 parts Han from kana, splits
# words at a case change and keeps a contraction on its word.
PROBE = "Call 12345 now: 你好世界ありがとう HelloWorld they're\n\n x=\"y\""
PROBE_PIECES = {
    "glm4": ["Call", " ", "123", "45", " now", ":", " 你好世界ありがとう", " HelloWorld", " they",
             "'re", "\n\n", " x", '="', "y", '"'],
    "deepseek-v3": ["Call", " ", "123", "45", " now", ":", " ", "你好世界ありがとう", " HelloWorld",
                    " they", "'re", "\n\n", " x", '="', "y", '"'],
    "kimi-k2": ["Call", " ", "123", "45", " now", ":", " ", "你好世界", "ありがとう", " Hello",
                "World", " they're", "\n\n", " x", '="', "y", '"'],
}


def llama_cpp_tensors(hf: dict[str, np.ndarray], cfg: dict,
                      layout: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as DeepseekV2Model.modify_tensors hands them on, under the
    names gguf-py's tensor map reads."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    for name, tensor in hf.items():
        if match := EXPERT.fullmatch(name):
            stacked = f"model.layers.{match[1]}.mlp.experts.{match[3]}.weight"
            experts.setdefault(stacked, {})[int(match[2])] = tensor
        elif layout == "split" and (match := KV_B.fullmatch(name)):
            per_head = tensor.reshape(heads, -1, tensor.shape[-1])
            out[f"{match[1]}k_b_proj.weight"] = per_head[:, :nope].swapaxes(1, 2).copy()
            out[f"{match[1]}v_b_proj.weight"] = per_head[:, nope:].copy()
        else:
            out[name.replace(BIAS, "e_score_correction.bias")] = tensor
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def stored(gguf_name: str, tensor: np.ndarray,
           outtype: str) -> tuple[np.ndarray, Q | None, np.ndarray]:
    """(array to write, its raw type or None, the float32 values it holds) for `--outtype`."""
    keep_f32 = (outtype == "f32" or tensor.ndim <= 1 or gguf_name.endswith("_norm.weight")
                or ".ffn_gate_inp." in gguf_name or not gguf_name.endswith(".weight"))
    if keep_f32:
        return tensor, None, tensor
    try:
        raw = quantize(tensor, Q.Q8_0)
    except gguf.QuantError:  # llama.cpp falls back to F16
        half = tensor.astype(np.float16)
        return half, None, half.astype(np.float32)
    return raw, Q.Q8_0, dequantize(raw, Q.Q8_0).reshape(tensor.shape)


def add_metadata(writer: GGUFWriter, cfg: dict, layout: str, mtp_layers: int,
                 pre: str) -> None:
    """What TextModel's and DeepseekV2Model's `set_gguf_parameters` write for this config
    (the released configs have no head_dim, so none is written from it)."""
    rope, rank = cfg["rope_parameters"], cfg["kv_lora_rank"]
    nope, rot, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    writer.add_block_count(cfg["num_hidden_layers"] + mtp_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(1)  # MLA as MQA
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(cfg["n_routed_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_group_count(cfg["n_group"])
    writer.add_expert_group_used_count(cfg["topk_group"])
    if cfg.get("scoring_func") is not None:
        writer.add_expert_gating_func({"sigmoid": ExpertGatingFuncType.SIGMOID,
                                       "softmax": ExpertGatingFuncType.SOFTMAX}[
                                           cfg["scoring_func"]])
    writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg["q_lora_rank"] is not None:
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    if layout == "split":
        writer.add_key_length(rank + rot)
        writer.add_value_length(rank)
        writer.add_key_length_mla(nope + rot)
        writer.add_value_length_mla(v)
    else:  # before the split: the heads' own sizes
        writer.add_key_length(nope + rot)
        writer.add_value_length(v)
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg["norm_topk_prob"]:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rot)
    if rope.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    copy_tokenizer_metadata(writer, VOCAB, pre=pre)
    writer.add_token_scores([0.0] * VOCAB)


def write_deepseek2_gguf(hf_dir: Path, root: Path, outtype: str, layout: str,
                         mtp_layers: int = 0, pre: str | None = None) -> tuple[Path, Path]:
    """(the GGUF of `hf_dir`'s model, `hf_dir` with each tensor as the GGUF stores it).
    `pre`: its tokenizer.ggml.pre (default: the family's, which tells GLM-4.7-Flash apart)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    if pre is None:
        pre = "glm4" if cfg["model_type"] == "glm4_moe_lite" else "deepseek-v3"
    hf = load_file(hf_dir / "model.safetensors")
    path = root / f"deepseek2-{outtype}.gguf"
    writer = GGUFWriter(path, "deepseek2")
    add_metadata(writer, cfg, layout, mtp_layers, pre)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2,
                                     cfg["num_hidden_layers"] + mtp_layers)
    rounded: dict[str, np.ndarray] = {}
    for name, tensor in llama_cpp_tensors(hf, cfg, layout).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        data, raw_dtype, rounded[name] = stored(gguf_name, tensor, outtype)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
    add_mtp_block(writer, cfg, mtp_layers)
    finish(writer)

    reference = root / "reference"
    reference.mkdir()
    save_file(held_tensors(hf, rounded, cfg), reference / "model.safetensors",
              metadata={"format": "pt"})
    (reference / "config.json").write_text(json.dumps(cfg))
    return path, reference


def held_tensors(hf: dict[str, np.ndarray], rounded: dict[str, np.ndarray],
                 cfg: dict) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with the values the file holds for them."""
    held = {}
    for name in hf:
        if match := EXPERT.fullmatch(name):
            held[name] = rounded[f"model.layers.{match[1]}.mlp.experts.{match[3]}.weight"][
                int(match[2])]
        elif (match := KV_B.fullmatch(name)) and name not in rounded:
            keys = rounded[f"{match[1]}k_b_proj.weight"].swapaxes(1, 2)
            values = rounded[f"{match[1]}v_b_proj.weight"]
            held[name] = np.concatenate([keys, values], axis=1).reshape(hf[name].shape)
        else:
            held[name] = rounded[name.replace(BIAS, "e_score_correction.bias")]
    return held


def add_mtp_block(writer: GGUFWriter, cfg: dict, mtp_layers: int) -> None:
    """A few tensors of GLM-4.7-Flash's multi-token-prediction block, after the decoder's."""
    hidden, rng = cfg["hidden_size"], np.random.default_rng(1)
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    for layer in range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + mtp_layers):
        writer.add_tensor(f"blk.{layer}.nextn.eh_proj.weight",
                          rng.standard_normal((hidden, 2 * hidden)).astype(np.float32))
        writer.add_tensor(f"blk.{layer}.attn_kv_a_mqa.weight",
                          rng.standard_normal((latent, hidden)).astype(np.float32))
        for norm in ("nextn.enorm", "nextn.hnorm", "attn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, np.float32))


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek2_gguf_converts_to_the_hf_model(case: str, tmp_path: Path) -> None:

    model_type, outtype, layout, pre, extra = CASES[case]
    glm = model_type == "glm4_moe_lite"
    source = tmp_path / "hf"
    # DeepSeek V3's and Kimi K2's configs name their routing; GLM-4.7-Flash's does not.
    build_tiny_model(model_type, source, **extra, **({} if glm else {"scoring_func": "sigmoid"}))
    path, reference = write_deepseek2_gguf(source, tmp_path, outtype, layout,
                                           mtp_layers=1 if glm else 0, pre=pre)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    if outtype == "q8_0":  # the case stores what it is named for
        assert types["blk.1.ffn_gate_exps.weight"] == Q.Q8_0
        assert types["blk.1.ffn_gate_inp.weight"] == Q.F32
        if layout == "split":
            assert types["blk.0.attn_v_b.weight"] == Q.Q8_0
            assert types["blk.0.attn_k_b.weight"] == (
                Q.Q8_0 if extra.get("qk_nope_head_dim") == 32 else Q.F16)
        else:
            assert types["blk.0.attn_kv_b.weight"] == Q.Q8_0
    out = convert_model(path, tmp_path / "out", progress=False)

    got = load_file(out / "model.safetensors")
    expected = {}
    for name, tensor in load_file(reference / "model.safetensors").items():
        if match := EXPERT.fullmatch(name):  # one expert's slice of the stack
            layer, expert, proj = match.groups()
            stack = got[f"model.layers.{layer}.mlp.switch_mlp.{proj}.weight"]
            np.testing.assert_array_equal(stack[int(expert)], tensor, err_msg=name)
            expected[f"model.layers.{layer}.mlp.switch_mlp.{proj}.weight"] = stack
        else:
            np.testing.assert_array_equal(got[name], tensor, err_msg=name)
            expected[name] = tensor
    assert set(got) == set(expected)  # and no multi-token-prediction tensors

    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == model_type
    ours = assert_converts_to(reference, path, out)
    assert ours.mla is not None and ours.moe is not None
    assert_tokenizer_of(out, pre)


def assert_tokenizer_of(out: Path, pre: str) -> None:
    """The converted dir's tokenizer, as serving loads it: the GGUF's chat template and
    special tokens, and llama.cpp's split for the file's pre-tokenizer."""
    tokenizer = load_tokenizer(out)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(PROBE)
    assert [PROBE[start:end] for _, (start, end) in pieces] == PROBE_PIECES[pre]


@pytest.mark.parametrize("scoring_func", ["softmax", None])
def test_softmax_routed_deepseek2_gguf_is_refused(scoring_func: str | None,
                                                  tmp_path: Path) -> None:
    """DeepSeek V2's routing (softmax; llama.cpp assumes it where a non-GLM file names no
    gating function) is not DeepSeek V3's: refused before anything is written."""
    source = tmp_path / "hf"
    build_tiny_model("deepseek_v3", source, scoring_func=scoring_func)
    path, _ = write_deepseek2_gguf(source, tmp_path, "f32", "split")
    with pytest.raises(ValueError, match="gating function 1"):
        convert_model(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.707, None])
def test_deepseek2_yarn_config(mscale_all_dim: float | None) -> None:
    """YaRN as DeepSeek's configs have it: `mscale_all_dim` read back from llama.cpp's
    `0.1 * mscale_all_dim` (float32), `mscale` equal to it as llama.cpp takes it; a file
    without the multiplier had neither in its config."""
    from convert.gguf_mla import deepseek2_keys

    stored = {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
        "expert_gating_func": 2, "leading_dense_block_count": 1, "attention.head_count": 4,
        "attention.kv_lora_rank": 32, "attention.key_length_mla": 24,
        "attention.value_length_mla": 12, "rope.dimension_count": 8,
        "rope.scaling.type": "yarn", "rope.scaling.factor": float(np.float32(40.0)),
        "rope.scaling.original_context_length": 4096,
        "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
    }
    if mscale_all_dim is not None:
        stored["rope.scaling.yarn_log_multiplier"] = float(np.float32(0.1 * mscale_all_dim))
    keys = deepseek2_keys("deepseek_v3", stored.get, {"model.layers.1.mlp.gate.weight"}, 2)
    expected = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0}
    if mscale_all_dim is not None:
        expected.update(mscale=mscale_all_dim, mscale_all_dim=mscale_all_dim)
    assert keys["rope_scaling"] == expected
    sizes = (keys["qk_nope_head_dim"], keys["v_head_dim"], keys["num_key_value_heads"])
    assert sizes == (16, 12, 4)


def test_split_kv_b_pairs_are_joined_and_an_unsplit_one_wins() -> None:
    """Each layer's attn_k_b / attn_v_b pair becomes one kv_b_proj; a file that also holds
    attn_kv_b (written while llama.cpp's converter kept both) keeps that one; a lone half is
    left for the layout check to name."""
    from convert.gguf_mla import SplitKvB, join_kv_b

    attn = "model.layers.{}.self_attn.{}_proj.weight"
    tensors = {attn.format(0, "k_b"): "k0", attn.format(0, "v_b"): "v0",
               attn.format(1, "kv_b"): "kv1", attn.format(1, "k_b"): "k1",
               attn.format(1, "v_b"): "v1", attn.format(2, "k_b"): "k2"}
    assert join_kv_b(tensors) == {attn.format(0, "kv_b"): SplitKvB("k0", "v0"),
                                  attn.format(1, "kv_b"): "kv1", attn.format(2, "k_b"): "k2"}
