"""Writing GGUF files in tests the way llama.cpp's converter does: its Q/K row order, tokenizer
metadata borrowed from the default model, K-quant blocks, and its hybrid linear-attention
archs (qwen35, qwen35moe, qwen3next) from a Hugging Face checkpoint."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file

from convert.default_model import default_gguf_path

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# K-quant block bytes, and where each block's float16 scale(s) sit: gguf cannot quantize to K
# types, so tests write random blocks with sane scales.
K_BLOCKS = {Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


def llama_cpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (interleaves the two rotary halves)."""
    half = rows.shape[0] // n_heads // 2
    return rows.reshape(n_heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def stored_tensor(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q):
    """(array to write, its raw qtype or None, the float32 values a correct reader recovers)."""
    weights = rng.standard_normal(shape).astype(np.float32)
    if qtype == Q.F32:
        return weights, None, weights
    if qtype == Q.F16:
        return weights.astype(np.float16), None, weights.astype(np.float16).astype(np.float32)
    if qtype in K_BLOCKS:
        size, scale_offsets = K_BLOCKS[qtype]
        blocks = rng.integers(0, 256, size=(shape[0], shape[1] // 256, size), dtype=np.uint8)
        for offset in scale_offsets:
            blocks[..., offset:offset + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
        if qtype != Q.Q6_K:  # the block's min scale (dmin) follows its scale
            blocks[..., 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
        raw = blocks.reshape(shape[0], -1)
        return raw, qtype, dequantize(raw, qtype)
    raw = quantize(weights, qtype)
    return raw, qtype, dequantize(raw, qtype)


@functools.cache
def default_tokenizer_metadata(vocab: int) -> tuple[str, list[str], list[int], list[str]]:
    """The default model's first `vocab` tokens and the merges among them (read once: slow)."""
    fields = GGUFReader(default_gguf_path()).fields
    tokens = fields["tokenizer.ggml.tokens"].contents(slice(0, vocab))
    known = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"].contents()
              if set(m.split(" ")) <= known and m.replace(" ", "") in known]
    types = fields["tokenizer.ggml.token_type"].contents(slice(0, vocab))
    return fields["tokenizer.ggml.pre"].contents(), tokens, types, merges


def copy_tokenizer_metadata(writer: GGUFWriter, vocab: int, pre: str | None = None) -> None:
    """The default model's tokenizer metadata; `pre` names another pre-tokenizer."""
    default_pre, tokens, types, merges = default_tokenizer_metadata(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or default_pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)


def finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# llama.cpp's hybrid archs, by the Hugging Face text model_type they convert.
HYBRID_ARCHS = {"qwen3_5_text": gguf.MODEL_ARCH.QWEN35,
                "qwen3_5_moe_text": gguf.MODEL_ARCH.QWEN35MOE,
                "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT}
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")


def write_hybrid_gguf(hf_dir: Path, path: Path, mtp_layers: int = 0) -> Path:
    """What llama.cpp's convert_hf_to_gguf.py writes (in float32) for the Qwen3.5 / Qwen3-Next
    checkpoint `hf_dir`, named by gguf-py's own tensor map; `mtp_layers` multi-token-prediction
    blocks are counted in block_count and given a few tensors, as llama.cpp stores them."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = HYBRID_ARCHS[cfg["model_type"]]
    writer = GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    _add_hybrid_metadata(writer, cfg, mtp_layers)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"] + mtp_layers)
    for name, tensor in llama_cpp_hybrid_tensors(load_file(hf_dir / "model.safetensors"),
                                                 cfg).items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor)
    hidden, rng = cfg["hidden_size"], np.random.default_rng(1)
    for layer in range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + mtp_layers):
        writer.add_tensor(f"blk.{layer}.nextn.eh_proj.weight",
                          rng.standard_normal((hidden, 2 * hidden)).astype(np.float32))
        for norm in ("nextn.enorm", "nextn.hnorm", "attn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, np.float32))
    finish(writer)
    return path


def llama_cpp_hybrid_tensors(hf: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as llama.cpp's Qwen3Next / Qwen3.5 converters change them,
    under Hugging Face names gguf-py's map knows (see convert.gguf_hybrid for the list)."""
    key_heads, value_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    tiled = cfg["model_type"] != "qwen3_next" and key_heads != value_heads
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in hf.items():
        if match := EXPERT.fullmatch(name):
            stacked = f"model.layers.{match[1]}.mlp.experts.{match[3]}.weight"
            experts.setdefault(stacked, {})[int(match[2])] = tensor
            continue
        if tiled and ".linear_attn." in name:
            tensor = _tiled(name, tensor, cfg)
        if name.endswith(".A_log"):
            tensor = -np.exp(tensor)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix("dt_bias") + "dt_proj.bias"
        elif "conv1d" in name:
            tensor = tensor.squeeze(1)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor = tensor + np.float32(1)
        if name.endswith("in_proj_qkvz.weight"):
            out.update(_split_qkvz(name, tensor, cfg))
        else:
            out[name] = tensor
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def _tiled(name: str, tensor: np.ndarray, cfg: dict) -> np.ndarray:
    """llama.cpp's value-head reorder for Qwen3.5: from grouped by key head to tiled."""
    key_heads, value_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    values = 2 * key_heads * cfg["linear_key_head_dim"]

    def tile(t: np.ndarray, axis: int) -> np.ndarray:
        moved = np.moveaxis(t, axis, 0)
        head = moved.shape[0] // value_heads
        grouped = moved.reshape(key_heads, value_heads // key_heads, head, *moved.shape[1:])
        return np.moveaxis(grouped.swapaxes(0, 1).reshape(moved.shape), 0, axis)

    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([tensor[:values], tile(tensor[values:], 0)])
    if name.endswith("out_proj.weight"):
        return tile(tensor, 1)
    if name.endswith("norm.weight"):  # one norm for every head
        return tensor
    return tile(tensor, 0)


def _split_qkvz(name: str, tensor: np.ndarray, cfg: dict) -> dict[str, np.ndarray]:
    """Qwen3-Next's per-key-head [q k v z] rows as llama.cpp stores them: q, k, v of every head
    (`attn_qkv`), then z (`attn_gate`)."""
    dk, key_heads = cfg["linear_key_head_dim"], cfg["linear_num_key_heads"]
    dv = cfg["linear_num_value_heads"] // key_heads * cfg["linear_value_head_dim"]
    per_head = tensor.reshape(key_heads, 2 * dk + 2 * dv, -1)
    q, k, v, z = np.split(per_head, [dk, 2 * dk, 2 * dk + dv], axis=1)
    prefix = name.removesuffix("in_proj_qkvz.weight")
    flat = [part.reshape(-1, tensor.shape[-1]) for part in (q, k, v, z)]
    return {f"{prefix}in_proj_qkv.weight": np.concatenate(flat[:3]),
            f"{prefix}in_proj_z.weight": flat[3]}


def add_decoder_metadata(writer: GGUFWriter, cfg: dict, num_blocks: int) -> None:
    """The keys every llama.cpp decoder's `set_gguf_parameters` writes from a transformers
    config: sizes, heads, rope theta, norm epsilon, head dims."""
    writer.add_block_count(num_blocks)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])


def _add_hybrid_metadata(writer: GGUFWriter, cfg: dict, mtp_layers: int) -> None:
    """The keys llama.cpp's Qwen3Next / Qwen3.5 `set_gguf_parameters` write from this config."""
    types = cfg["layer_types"]
    interval = types.index("full_attention") + 1
    assert all((t == "full_attention") == ((i + 1) % interval == 0) for i, t in enumerate(types))
    head_dim, rope = cfg["head_dim"], cfg["rope_parameters"]
    add_decoder_metadata(writer, cfg, cfg["num_hidden_layers"] + mtp_layers)
    writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(cfg["linear_key_head_dim"])
    writer.add_ssm_group_count(cfg["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    writer.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    writer.add_full_attention_interval(interval)
    writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    if cfg["model_type"] != "qwen3_next":
        writer.add_rope_dimension_sections([*rope.get("mrope_section", [11, 11, 10]), 0])
    if "num_experts" in cfg:
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    copy_tokenizer_metadata(writer, cfg["vocab_size"])
    writer.add_token_scores([0.0] * cfg["vocab_size"])
