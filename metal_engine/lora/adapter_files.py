"""Read a LoRA adapter dir into one low-rank pair per targeted module, in one layout.

Two layouts are read:

    PEFT     adapter_config.json {r, lora_alpha, use_rslora, target_modules, ...}
             adapter_model.safetensors  base_model.model.<module>.lora_A.weight  [r, in]
                                        base_model.model.<module>.lora_B.weight  [out, r]
    mlx-lm   adapter_config.json {fine_tune_type, lora_parameters: {rank, scale, keys}}
             adapters.safetensors       <module>.lora_a  [in, r]
                                        <module>.lora_b  [r, out]

Both become `LoraAdapter.pairs`: module path (the model's parameter names, e.g.
`model.layers.0.self_attn.q_proj`) -> (A `[r, in]`, B `[out, r]` with the scale folded in),
so a module's delta is `(x @ A.T) @ B.T`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx

PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_LM_WEIGHTS = "adapters.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    base_model: str | None  # what the adapter says it was trained on (informational)
    pairs: dict[str, tuple[mx.array, mx.array]]  # module -> (A [r, in], scale * B [out, r])
    # Of its files' bytes: what its cached K/V are keyed by, so that other weights loaded
    # under the same name (now, or after a restart with a disk tier) never meet them.
    fingerprint: str = ""


def load_adapter(name: str, path: str | Path) -> LoraAdapter:
    """The adapter in dir `path`; ValueError naming the file and the problem if it cannot
    be served (a missing or corrupt file, DoRA, unpaired tensors, ...)."""
    path = Path(path)
    config = _read_config(name, path)
    if (path / PEFT_WEIGHTS).exists():
        weights = path / PEFT_WEIGHTS
        adapter = _peft_adapter(name, config, _read_tensors(name, weights))
    elif (path / MLX_LM_WEIGHTS).exists():
        weights = path / MLX_LM_WEIGHTS
        adapter = _mlx_lm_adapter(name, config, _read_tensors(name, weights))
    else:
        raise ValueError(f"adapter {name!r}: {path} has neither {PEFT_WEIGHTS} (PEFT) nor "
                         f"{MLX_LM_WEIGHTS} (mlx-lm)")
    return replace(adapter, fingerprint=_fingerprint(path / "adapter_config.json", weights))


def _fingerprint(*files: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        with file.open("rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def _read_config(name: str, path: Path) -> dict:
    file = path / "adapter_config.json"
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"adapter {name!r}: {file} is missing") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"adapter {name!r}: cannot read {file}: {e}") from None


def _read_tensors(name: str, file: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(file))
    except Exception as e:  # MLX raises RuntimeError/ValueError on a truncated or foreign file
        raise ValueError(f"adapter {name!r}: cannot read {file} (corrupt or not safetensors): "
                         f"{e}") from None


def _peft_adapter(name: str, config: dict, tensors: dict[str, mx.array]) -> LoraAdapter:
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"adapter {name!r}: only plain LoRA is served, not "
                         f"{'DoRA' if config.get('use_dora') else config.get('peft_type')}")
    for field in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(field):
            raise ValueError(f"adapter {name!r}: `{field}` is not supported (it is "
                             f"{config[field]!r}); merge those modules into the base instead")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r}: trained biases (bias={config['bias']!r}) are not "
                         "supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = _partner(name, tensors, key.replace(".lora_A.", ".lora_B."))
        pairs[module] = (a, b * scale)
    _check_all_paired(name, tensors, pairs, (".lora_A.weight", ".lora_B.weight"))
    return LoraAdapter(name, rank, config.get("base_model_name_or_path"), pairs)


def _mlx_lm_adapter(name: str, config: dict, tensors: dict[str, mx.array]) -> LoraAdapter:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ValueError(f"adapter {name!r}: fine_tune_type {kind!r} is not served (only lora)")
    params = config.get("lora_parameters", {})
    rank = int(params.get("rank", 8))
    scale = float(params["scale"]) if "scale" in params else float(
        params.get("alpha", rank)) / rank
    pairs = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_a"):
            continue
        module = key.removesuffix(".lora_a")
        b = _partner(name, tensors, module + ".lora_b")
        pairs[module] = (a.T, b.T * scale)
    _check_all_paired(name, tensors, pairs, (".lora_a", ".lora_b"))
    return LoraAdapter(name, rank, config.get("model"), pairs)


def _partner(name: str, tensors: dict[str, mx.array], key: str) -> mx.array:
    if key not in tensors:
        raise ValueError(f"adapter {name!r}: {key} is missing (each A needs its B)")
    return tensors[key]


def _check_all_paired(name: str, tensors: dict[str, mx.array], pairs: dict,
                      suffixes: tuple[str, str]) -> None:
    """Every tensor is one of a pair; an unknown one (quantized LoRA, a saved module) is
    refused rather than ignored."""
    stray = sorted(k for k in tensors if not k.endswith(suffixes))
    if stray or len(tensors) != 2 * len(pairs):
        raise ValueError(f"adapter {name!r}: tensors that are not LoRA pairs: "
                         f"{', '.join(stray[:5]) or 'a B without its A'}")
    if not pairs:
        raise ValueError(f"adapter {name!r}: no LoRA weights in its safetensors file")
