"""Open a llama.cpp GGUF file as a ModelSource: dequantize, rename, undo llama.cpp's changes.
MXFP4 expert stacks (gpt-oss) stay quantized, re-laid as MLX's mxfp4 (convert.gguf_mxfp4).
Multi-token-prediction blocks (GLM-4.5's, Qwen3.5's, GLM-4.7-Flash's) are left out; MLA's
split `kv_b_proj` is joined (convert.gguf_mla)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from convert.fused_projections import unfuse, unfused_shapes
from convert.gguf_archs import (
    ARCHS,
    GgufArch,
    gguf_arch,
    head_dim,
    llama3_rope_scaling,
    rope_scaling,
)
from convert.gguf_hybrid import restore_hybrid
from convert.gguf_mla import SplitKvB, join_kv_b
from convert.gguf_mxfp4 import mlx_mxfp4
from convert.layout import check_tensors, tensor_shapes
from convert.source import ModelSource
from convert.tokenizer_files import write_gguf_tokenizer
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.quantization import MXFP4, QuantParams

# Types gguf.quants can dequantize in numpy.
SUPPORTED_TYPES = frozenset({
    QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0,
    QType.Q5_1, QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.MXFP4,
})
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Llama 3.x rope scaling as llama.cpp stores it: one divisor per rotary frequency.
ROPE_FREQS = "rope_freqs.weight"
# The suffix is absent where the Hugging Face name has none (Qwen3.5's `A_log` is `ssm_a`).
NAME_RE = re.compile(r"(?:blk\.(\d+)\.)?(\w+?)(?:\.(weight|bias))?")
BLOCK_RE = re.compile(r"blk\.(\d+)\.")
# A tensor of the file, or one rebuilt from two of them (MLA's kv_b_proj).
GgufTensor = ReaderTensor | SplitKvB


def open_gguf(path: Path) -> ModelSource:
    """Read metadata and tensor headers, validate them; dequantize nothing yet."""
    reader = GGUFReader(path)
    arch_name = _check_file(reader)
    arch = gguf_arch(arch_name, lambda key: _get(reader, f"{arch_name}.{key}"),
                     _get(reader, "tokenizer.ggml.pre"))
    _check_types(reader.tensors)
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    layers = _main_layers(reader, arch_name)
    tensors = join_kv_b({hf_name(t.name, arch): t for t in reader.tensors
                         if t.name != ROPE_FREQS and not _beyond_layers(t.name, layers)})
    config = _config_from_metadata(reader, arch_name, arch, tensors, rope_freqs)
    expected = tensor_shapes(config)
    found = unfused_shapes(config, {n: _hf_shape(t) for n, t in tensors.items()})
    check_tensors({n: _squeezed_as(shape, expected.get(n)) for n, shape in found.items()},
                  expected)
    quantized = _mxfp4_expert_stacks(tensors)
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    return ModelSource(
        kind="gguf",
        path=path,
        config=config,
        base_config={},
        tensors=partial(_read_tensors, tensors, config, arch, quantized),
        write_tokenizer=partial(write_gguf_tokenizer, path, eos_token_id=eos),
        files=(path,),
        quantized=quantized,
    )


def hf_name(gguf_name: str, arch: GgufArch) -> str:
    """llama.cpp tensor name -> Hugging Face name, e.g. blk.3.attn_q.weight -> ...q_proj.weight."""
    match = NAME_RE.fullmatch(gguf_name)
    table = arch.block_names if match and match[1] is not None else GLOBAL_NAMES
    prefix = f"model.layers.{match[1]}." if match and match[1] is not None else ""
    if match is not None and f"{match[2]}.{match[3]}" in table:  # renamed with its suffix
        return prefix + table[f"{match[2]}.{match[3]}"]
    if match is None or match[2] not in table:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no {arch.model_type} equivalent")
    return prefix + table[match[2]] + (f".{match[3]}" if match[3] else "")


def undo_rope_permutation(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q_proj/k_proj weights (or biases).

    Per head, llama.cpp stores row (j, p) at j*2 + p, where Hugging Face keeps it at p*half + j.
    """
    half = rows.shape[0] // n_heads // 2
    heads = rows.reshape(n_heads, half, 2, *rows.shape[1:])
    return heads.swapaxes(1, 2).reshape(rows.shape)


def _check_file(reader: GGUFReader) -> str:
    arch = _get(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; the converter handles "
                         f"{', '.join(ARCHS)} (Mistral and Mixtral GGUFs are 'llama')")
    if (_get(reader, "split.count") or 1) > 1:
        raise ValueError(
            "this GGUF is one part of a split model; merge the parts first "
            "(llama-gguf-split --merge first-part.gguf merged.gguf)"
        )
    return arch


def _main_layers(reader: GGUFReader, arch_name: str) -> int:
    """The decoder layers: block_count less the multi-token-prediction blocks llama.cpp counts
    in it (GLM-4.5), which this engine does not run (transformers does not either)."""
    blocks = _require(reader, f"{arch_name}.block_count")
    return blocks - (_get(reader, f"{arch_name}.nextn_predict_layers") or 0)


def _beyond_layers(gguf_name: str, layers: int) -> bool:
    match = BLOCK_RE.match(gguf_name)
    return match is not None and int(match[1]) >= layers


def _check_types(tensors: list[ReaderTensor]) -> None:
    for tensor in tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise ValueError(
                f"GGUF tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the "
                f"converter cannot dequantize; supported types: {supported}"
            )


def _mxfp4_expert_stacks(tensors: dict[str, GgufTensor]) -> dict[str, QuantParams]:
    """The expert stacks (module paths) stored as MXFP4: kept so, as MLX runs them."""
    return {name.removesuffix(".weight"): MXFP4 for name, t in tensors.items()
            if t.tensor_type == QType.MXFP4 and len(t.shape) == 3 and name.endswith(".weight")}


def _config_from_metadata(reader: GGUFReader, arch_name: str, arch: GgufArch,
                          tensors: dict[str, GgufTensor],
                          rope_freqs: ReaderTensor | None) -> ModelConfig:
    """The Hugging Face config keys llama.cpp's metadata describes, read like a config.json."""

    def meta(key: str) -> Any:
        return _get(reader, f"{arch_name}.{key}")

    def required(key: str) -> Any:
        return _require(reader, f"{arch_name}.{key}")

    hidden = required("embedding_length")
    heads = required("attention.head_count")
    head_size = head_dim(meta, arch)
    layers = _main_layers(reader, arch_name)
    theta = _shortest(meta("rope.freq_base") or 10000.0)
    scaling = rope_scaling(meta) if rope_freqs is None else llama3_rope_scaling(
        dequantize(rope_freqs.data, rope_freqs.tensor_type), theta, head_size)
    keys = dict(
        model_type=arch.model_type,
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=meta("attention.head_count_kv") or heads,
        head_dim=head_size,
        vocab_size=meta("vocab_size") or _token_count(reader),
        rms_norm_eps=_shortest(meta("attention.layer_norm_rms_epsilon") or 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=meta("context_length") or 2048,
        tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=_get(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_get(reader, "tokenizer.ggml.eos_token_id"),
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        mlp_bias="model.layers.0.mlp.gate_proj.bias" in tensors,
    )
    keys.update(arch.config_keys(arch_name, meta, tensors, layers))  # may refine shared ones
    if keys["intermediate_size"] is None:
        required("feed_forward_length")  # raises, naming it
    return ModelConfig.from_dict(keys)


def _squeezed_as(shape: tuple[int, ...], expected: tuple[int, ...] | None) -> tuple[int, ...]:
    """`expected` where `shape` is it less its 1-wide dims (llama.cpp squeezes Qwen3.5's conv
    weights), else `shape`."""
    if expected is not None and [d for d in shape if d != 1] == [d for d in expected if d != 1]:
        return expected
    return shape


def _read_tensors(tensors: dict[str, GgufTensor], config: ModelConfig, arch: GgufArch,
                  quantized: dict[str, QuantParams]) -> Iterator[tuple[str, Any]]:
    """Every tensor of the layout; Qwen3-Next's fused `in_proj_ba` is split on the way."""
    return unfuse(config, _restored_tensors(tensors, config, arch, quantized))


def _restored_tensors(tensors: dict[str, GgufTensor], config: ModelConfig, arch: GgufArch,
                      quantized: dict[str, QuantParams]) -> Iterator[tuple[str, Any]]:
    expected = tensor_shapes(config)
    for name, tensor in tensors.items():
        shape = expected.get(name) or _hf_shape(tensor)
        module = name.removesuffix(".weight")
        if module in quantized:
            weight, scales = mlx_mxfp4(tensor.data, shape)
            yield name, weight
            yield f"{module}.scales", scales
            continue
        if isinstance(tensor, SplitKvB):
            yield name, tensor.joined()
            continue
        weights = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if arch.permutes_qk and ".q_proj." in name:
            weights = undo_rope_permutation(weights, config.num_attention_heads)
        elif arch.permutes_qk and ".k_proj." in name:
            weights = undo_rope_permutation(weights, config.num_key_value_heads)
        elif arch.norm_offset and name.endswith("norm.weight"):
            weights = weights - np.float32(arch.norm_offset)
        elif arch.value_heads is not None:
            weights = restore_hybrid(name, weights, config, arch.value_heads == "tiled")
        yield name, weights


def _hf_shape(tensor: GgufTensor) -> tuple[int, ...]:
    # GGUF lists dims fastest-first (ggml order); Hugging Face lists them [out, in].
    return tuple(int(d) for d in reversed(tensor.shape))


def _get(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _require(reader: GGUFReader, key: str) -> Any:
    value = _get(reader, key)
    if value is None:
        raise ValueError(f"the GGUF metadata lacks {key!r}; the file is incomplete")
    return value


def _token_count(reader: GGUFReader) -> int:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("the GGUF metadata has neither a vocab_size nor a token list")
    return len(tokens.data)


def _shortest(value: float) -> float:
    # GGUF stores float32; write its shortest decimal form (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))
