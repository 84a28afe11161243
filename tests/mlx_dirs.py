"""Model dirs in mlx-lm's layout, written by tests, and the check that two dirs hold the same
checkpoint.

mlx-lm's Qwen3.5 and Qwen3-Next layout (mlx_lm/models/qwen3_5.py, qwen3_next.py: `sanitize`,
`quant_predicate`), as written here: a multimodal wrapper's tensors under `language_model.`
(`model.language_model.x` as `language_model.model.x`), its vision tower and the
multi-token-prediction head dropped; conv1d weights moved to MLX's `[C, K, 1]`; the `1 + w`
norms (decoder, final, q/k) with the 1 added, the gated one as it is; experts stacked under
`switch_mlp`; Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` kept fused. Quantized: every Linear,
Embedding and expert stack whose input width divides by the group size, the MoE routers and
shared-expert gates at 8 bits (group 64); convs, norms, `A_log` and `dt_bias` stay float.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx

SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                 "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
EXPERT = re.compile(r"(.+)\.experts\.(\d+)\.(\w+)\.weight")


def save_mlx_dir(out: Path, source: Path, tensors: dict[str, mx.array],
                 quantization: dict | None) -> Path:
    """What mlx-lm's convert leaves in `out`: the tensors, `source`'s config with the
    quantization entries (twice, as mlx-lm writes them; none for a float dir) and its
    tokenizer."""
    out.mkdir(exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    config = json.loads((source / "config.json").read_text())
    if quantization is not None:
        config["quantization"] = config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True))
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")
    return out


def write_mlx_lm_hybrid(source: Path, out: Path, bits: int | None = None,
                        group_size: int = 64) -> Path:
    """The dir mlx-lm's convert writes from the Hugging Face Qwen3.5 / Qwen3-Next checkpoint
    `source` (float, or with `-q --q-bits bits --q-group-size group_size`)."""
    config = json.loads((source / "config.json").read_text())
    tensors = mlx_lm_hybrid_tensors(mx.load(str(source / "model.safetensors")),
                                    multimodal="text_config" in config)
    if bits is None:
        return save_mlx_dir(out, source, tensors, None)
    moe = "num_experts" in config.get("text_config", config)
    entries: dict = {"group_size": group_size, "bits": bits, "mode": "affine"}
    quantized = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if (not name.endswith(".weight") or tensor.ndim < 2 or "conv1d" in name
                or tensor.shape[-1] % group_size):
            quantized[name] = tensor
            continue
        params = {"group_size": group_size, "bits": bits}
        if moe and module.endswith(("mlp.gate", "shared_expert_gate")):
            params = entries[module] = {"group_size": 64, "bits": 8}
        weight, scales, biases = mx.quantize(tensor, params["group_size"], params["bits"])
        quantized.update({name: weight, f"{module}.scales": scales, f"{module}.biases": biases})
    return save_mlx_dir(out, source, quantized, entries)


def mlx_lm_hybrid_tensors(hf: dict[str, mx.array], multimodal: bool) -> dict[str, mx.array]:
    """mlx-lm's `sanitize` of a Hugging Face Qwen3.5 / Qwen3-Next checkpoint's tensors."""
    tensors: dict[str, mx.array] = {}
    experts: dict[str, dict[int, mx.array]] = {}
    for name, tensor in hf.items():
        if name.startswith("model.visual") or "mtp." in name:
            continue
        if multimodal:
            name = (name.replace("model.language_model.", "language_model.model.", 1)
                    if name.startswith("model.language_model.") else f"language_model.{name}")
        if "conv1d.weight" in name:
            tensor = tensor.moveaxis(2, 1)
        elif name.endswith(SHIFTED_NORMS) and tensor.ndim == 1:
            tensor = tensor + 1.0
        if match := EXPERT.fullmatch(name):
            stacked = f"{match[1]}.switch_mlp.{match[3]}.weight"
            experts.setdefault(stacked, {})[int(match[2])] = tensor
        else:
            tensors[name] = tensor
    for name, by_expert in experts.items():
        tensors[name] = mx.stack([by_expert[e] for e in range(len(by_expert))])
    return tensors


def assert_same_checkpoint(theirs: Path, ours: Path) -> dict[str, mx.array]:
    """Same tensor names, dtypes and bits, and the same quantization entries; returns
    `theirs`' tensors."""
    their_tensors, our_tensors = (mx.load(str(d / "model.safetensors")) for d in (theirs, ours))
    assert set(our_tensors) == set(their_tensors)
    for name, tensor in their_tensors.items():
        assert our_tensors[name].dtype == tensor.dtype, name
        assert mx.array_equal(our_tensors[name], tensor), name
    their_config, our_config = (json.loads((d / "config.json").read_text())
                                for d in (theirs, ours))
    for key in ("quantization", "quantization_config"):
        assert our_config[key] == their_config[key], key
    return their_tensors
