"""GPT-OSS checkpoints with MXFP4 experts, written in tests the way OpenAI publishes them, and
mlx-community's layout of the same, as mlx-lm's gpt_oss sanitize and convert write it.

The MXFP4 encoding here is written from the format's definition (OCP Microscaling): per 32
values one E8M0 exponent (bias 127) and 32 FP4 e2m1 codes (sign bit 3, magnitudes 0, 0.5, 1,
1.5, 2, 3, 4, 6), two a byte with the even value in the low nibble.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_dirs import save_mlx_dir
from safetensors.numpy import load_file, save_file

FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
GROUP = 32
# What OpenAI's gpt-oss config.json leaves in float.
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]
FUSED = re.compile(r"(.+)\.experts\.(gate_up_proj|down_proj)")


def to_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`[..., rows, cols]` floats -> (blocks uint8 `[..., rows, cols / 32, 16]`, scales uint8
    `[..., rows, cols / 32]`): each block's exponent the smallest whose 6 covers its peak,
    each value the nearest code."""
    groups = weight.reshape(*weight.shape[:-1], -1, GROUP).astype(np.float64)
    peak = np.abs(groups).max(axis=-1)
    exponent = np.ceil(np.log2(np.maximum(peak, 2.0**-120) / 6)).clip(-127, 127)
    scaled = groups / 2.0 ** exponent[..., None]
    magnitude = np.abs(np.abs(scaled)[..., None] - FP4_MAGNITUDES).argmin(axis=-1)
    codes = (magnitude | np.where(np.signbit(scaled), 8, 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).astype(np.uint8)


def write_openai_mxfp4(float_dir: Path, out: Path) -> Path:
    """`float_dir`'s GPT-OSS checkpoint with its experts in MXFP4, as openai/gpt-oss-* store
    them: `experts.{gate_up,down}_proj_{blocks,scales}` in `[experts, out, ...]` order."""
    out.mkdir()
    tensors = {}
    for name, tensor in load_file(float_dir / "model.safetensors").items():
        if FUSED.fullmatch(name) is None:
            tensors[name] = tensor
            continue
        # transformers holds them [experts, in, out]; the blocks run along `in`.
        blocks, scales = to_mxfp4(np.ascontiguousarray(tensor.transpose(0, 2, 1)))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(float_dir / "tokenizer.json", out / "tokenizer.json")
    return out


def write_mlx_community_mxfp4(openai_dir: Path, out: Path,
                              quantize: tuple[int, int] | None = None) -> Path:
    """What mlx-lm's convert writes from `openai_dir`: the experts' blocks viewed as uint32 and
    flattened, gate and up rows split (even, odd), `quantization: {32, 4, mxfp4}`. With
    `quantize` (group size, bits; `-q`), every other Linear and Embedding whose width divides
    is affine-quantized, each listed with its params (the router at 8 bits, group 64)."""
    out.mkdir()
    entries: dict = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    tensors: dict[str, mx.array] = {}
    for name, tensor in mx.load(str(openai_dir / "model.safetensors")).items():
        tensors.update(_mlx_lm_sanitized(name, tensor))
    for name in [n for n, t in tensors.items() if quantize and _affine_candidate(n, t, quantize)]:
        module = name.removesuffix(".weight")
        # gpt_oss's quant_predicate gives the router its own params, without a mode.
        entries[module] = ({"group_size": 64, "bits": 8} if module.endswith("router") else
                           {"group_size": quantize[0], "bits": quantize[1], "mode": "affine"})
        packed = mx.quantize(tensors[name], entries[module]["group_size"],
                             entries[module]["bits"])
        tensors[name], tensors[f"{module}.scales"], tensors[f"{module}.biases"] = packed
    return save_mlx_dir(out, openai_dir, tensors, entries)


def _mlx_lm_sanitized(name: str, tensor: mx.array) -> dict[str, mx.array]:
    if "_blocks" in name:
        tensor, name = tensor.view(mx.uint32).flatten(-2), name.replace("_blocks", ".weight")
    name = name.replace("_scales", ".scales").replace("_bias", ".bias")
    if "gate_up_proj" not in name:
        return {name: tensor}
    return {name.replace("gate_up_proj", "gate_proj"): tensor[:, 0::2],
            name.replace("gate_up_proj", "up_proj"): tensor[:, 1::2]}


def _affine_candidate(name: str, tensor: mx.array, quantize: tuple[int, int]) -> bool:
    """A float Linear or Embedding weight mlx-lm's `-q` quantizes (not the MXFP4 experts)."""
    return (name.endswith(".weight") and tensor.ndim == 2 and ".experts." not in name
            and "norm" not in name and tensor.shape[-1] % quantize[0] == 0)
