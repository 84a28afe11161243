"""MoE GGUFs (llama.cpp's qwen3moe and glm4moe, and Mixtral, which it writes as llama) convert
to the stacked-expert layout and compute what the Hugging Face model they came from computes.

Each GGUF is written here from a tiny random transformers checkpoint the way llama.cpp's
converter arranges it: its tensor names, each layer's experts stacked into one 3-D tensor per
projection (stored Q8_0), Mixtral's q/k rows permuted as for Llama, GLM's correction bias as
`exp_probs_b.bias` and its multi-token prediction block counted in block_count, and the
metadata keys its `set_gguf_parameters` writes. The reference is that checkpoint with its
experts rounded as Q8_0 stores them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conversion_checks import assert_converts_to
from gguf import ExpertGatingFuncType, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_files import add_decoder_metadata, copy_tokenizer_metadata, finish, llama_cpp_permute
from safetensors.numpy import load_file, save_file
from tiny_models import VOCAB, build_tiny_model

from convert import convert_model

GGUF_ARCHS = {"qwen3_moe": "qwen3moe", "glm4_moe": "glm4moe", "mixtral": "llama"}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
# Hugging Face name within a layer -> llama.cpp's (gguf-py's tensor map for these archs).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attn_{g}.{kind}"
       for p, g in [("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")]
       for kind in ("weight", "bias")},
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    **{f"mlp.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")},
    **{f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight"
       for p in ("gate", "up", "down")},
}
# Qwen's post-attention norm is llama.cpp's ffn_norm; GLM-4.5's tensor list names it so.
POST_ATTENTION_NORM = {"qwen3_moe": "ffn_norm.weight", "glm4_moe": "post_attention_norm.weight",
                       "mixtral": "ffn_norm.weight"}
EXPERT = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
               "w1": "gate", "w3": "up", "w2": "down"}


def gguf_tensors(model_type: str, hf: dict[str, np.ndarray],
                 cfg: dict) -> dict[str, np.ndarray]:
    """The tensors llama.cpp's converter writes for this checkpoint (float, unquantized)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    heads = {"self_attn.q_proj.weight": cfg["num_attention_heads"],
             "self_attn.k_proj.weight": cfg["num_key_value_heads"]}
    for name, tensor in hf.items():
        if name in GLOBAL_NAMES:
            out[GLOBAL_NAMES[name]] = tensor
        elif match := EXPERT.fullmatch(name):
            experts.setdefault((match[1], PROJECTIONS[match[4]]), {})[int(match[3])] = tensor
        else:
            layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
            short = (POST_ATTENTION_NORM[model_type] if rest == "post_attention_layernorm.weight"
                     else LAYER_NAMES[rest])
            if model_type == "mixtral" and rest in heads:  # llama.cpp's rope row order
                tensor = llama_cpp_permute(tensor, heads[rest])
            out[f"blk.{layer}.{short}"] = tensor
    for (layer, proj), by_expert in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack(
            [by_expert[e] for e in range(len(by_expert))])
    return out


def add_metadata(writer: GGUFWriter, model_type: str, cfg: dict) -> None:
    """The metadata keys llama.cpp's converter writes from this config."""
    nextn = 1 if model_type == "glm4_moe" else 0
    add_decoder_metadata(writer, cfg, cfg["num_hidden_layers"] + nextn)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    copy_tokenizer_metadata(writer, VOCAB)
    writer.add_token_scores([0.0] * VOCAB)  # the first 128 tokens hold no merges to copy
    if model_type == "mixtral":  # llama's converter writes no expert width: it is the FFN's
        writer.add_rope_dimension_count(cfg["head_dim"])
        writer.add_expert_count(cfg["num_local_experts"])
        return
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if model_type == "qwen3_moe":
        writer.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
        return
    writer.add_expert_count(cfg["n_routed_experts"])
    writer.add_expert_group_count(cfg["n_group"])
    writer.add_expert_group_used_count(cfg["topk_group"])
    partial = cfg["rope_parameters"].get("partial_rotary_factor", 0.5)
    writer.add_rope_dimension_count(int(cfg["head_dim"] * partial))
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    writer.add_expert_weights_norm(cfg["norm_topk_prob"])
    writer.add_nextn_predict_layers(nextn)


def add_nextn_block(writer: GGUFWriter, layer: int, hidden: int) -> None:
    """A few of GLM-4.5's multi-token-prediction tensors, in the block after the decoder's."""
    rng = np.random.default_rng(1)
    writer.add_tensor(f"blk.{layer}.nextn.eh_proj.weight",
                      rng.standard_normal((hidden, 2 * hidden)).astype(np.float32))
    for name in ("nextn.enorm", "nextn.hnorm", "attn_norm"):
        writer.add_tensor(f"blk.{layer}.{name}.weight", np.ones(hidden, np.float32))


def write_moe_gguf(model_type: str, hf_dir: Path, root: Path) -> tuple[Path, Path]:
    """(the GGUF of `hf_dir`'s model, `hf_dir` with its experts rounded as the GGUF stores
    them: the reference)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(hf_dir / "model.safetensors")
    path = root / f"{GGUF_ARCHS[model_type]}.gguf"
    writer = GGUFWriter(path, GGUF_ARCHS[model_type])
    add_metadata(writer, model_type, cfg)
    rounded: dict[str, np.ndarray] = {}
    for name, tensor in gguf_tensors(model_type, hf, cfg).items():
        if tensor.ndim == 3:  # the experts: Q8_0, as a quantized GGUF stores them
            raw = quantize(tensor, Q.Q8_0)
            writer.add_tensor(name, raw, raw_dtype=Q.Q8_0)
            rounded[name] = dequantize(raw, Q.Q8_0).reshape(tensor.shape)
        else:
            writer.add_tensor(name, tensor)
    if model_type == "glm4_moe":
        add_nextn_block(writer, cfg["num_hidden_layers"], cfg["hidden_size"])
    finish(writer)

    reference = root / "reference"
    reference.mkdir()
    for name in hf:
        if match := EXPERT.fullmatch(name):
            proj = PROJECTIONS[match[4]]
            hf[name] = rounded[f"blk.{match[1]}.ffn_{proj}_exps.weight"][int(match[3])]
    save_file(hf, reference / "model.safetensors", metadata={"format": "pt"})
    if model_type == "mixtral":
        cfg["sliding_window"] = None  # llama.cpp's llama architecture has no window
    (reference / "config.json").write_text(json.dumps(cfg))
    return path, reference


@pytest.mark.parametrize("model_type", list(GGUF_ARCHS))
def test_moe_gguf_converts_to_the_hf_model(model_type: str, tmp_path: Path) -> None:

    source = tmp_path / "hf"
    build_tiny_model(model_type, source)
    path, reference = write_moe_gguf(model_type, source, tmp_path)
    out = convert_model(path, tmp_path / "out", progress=False)

    got = load_file(out / "model.safetensors")
    expected = load_file(reference / "model.safetensors")
    names = set()
    for name, tensor in expected.items():
        if match := EXPERT.fullmatch(name):  # one expert's slice of the stack
            layer, block, expert, proj = match.groups()
            name = f"model.layers.{layer}.{block}.switch_mlp.{PROJECTIONS[proj]}_proj.weight"
            assert got[name].ndim == 3, name
            np.testing.assert_array_equal(got[name][int(expert)], tensor, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], tensor, err_msg=name)
        names.add(name)
    assert set(got) == names  # and no multi-token-prediction tensors

    assert assert_converts_to(reference, path, out).moe is not None


def test_moe_gguf_with_an_unsupported_router_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "hf"
    build_tiny_model("glm4_moe", source)
    path, _ = write_moe_gguf("glm4_moe", source, tmp_path)
    from gguf import GGUFReader

    reader = GGUFReader(path, "r+")  # switch the gating function to softmax in place
    field = reader.fields["glm4moe.expert_gating_func"]
    field.parts[field.data[0]][0] = int(ExpertGatingFuncType.SOFTMAX)
    reader.data.flush()
    with pytest.raises(ValueError, match="scoring_func='softmax'"):
        convert_model(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
