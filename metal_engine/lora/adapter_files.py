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
so a module's delta is `(x @ A.T) @ B.T`; a MoE's experts' pairs carry a leading experts axis
(expert_pairs.py). The arrays are float32 numpy arrays: reading makes no MLX call, so it
may run beside the engine's steps on another thread.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np

from metal_engine.lora.expert_pairs import Pair, fused_expert_pairs, stacked_per_expert
from metal_engine.lora.host_tensors import read_float_tensors

PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_LM_WEIGHTS = "adapters.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    base_model: str | None  # what the adapter says it was trained on (informational)
    pairs: dict[str, Pair]  # module -> (A [(experts,) r, in], scale * B [(experts,) out, r])
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


def names_another_base(adapter: LoraAdapter, served: Sequence[str]) -> bool:
    """Whether the base the adapter names (PEFT's `base_model_name_or_path`, mlx-lm's
    `model`) is none of the `served` model's names. Loosely: a conversion renames its source
    (`Qwen/Qwen3-0.6B` served as `qwen3-0.6b-4bit`), so one name inside another matches."""
    if not adapter.base_model or not served:
        return False
    base = _plain_name(adapter.base_model)
    return not any(base in _plain_name(n) or _plain_name(n) in base for n in served)


def _plain_name(name: str) -> str:
    return Path(name.rstrip("/")).name.lower()


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


def _read_tensors(name: str, file: Path) -> dict[str, np.ndarray]:
    try:
        return read_float_tensors(file)
    except (OSError, ValueError) as e:
        raise ValueError(f"adapter {name!r}: cannot read {file} (corrupt or not safetensors): "
                         f"{e}") from None


def _peft_adapter(name: str, config: dict, tensors: dict[str, np.ndarray]) -> LoraAdapter:
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"adapter {name!r}: only plain LoRA is served, not "
                         f"{'DoRA' if config.get('use_dora') else config.get('peft_type')}")
    if config.get("modules_to_save"):
        raise ValueError(f"adapter {name!r}: `modules_to_save` is not supported (it is "
                         f"{config['modules_to_save']!r}); merge those modules into the base "
                         "instead")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r}: trained biases (bias={config['bias']!r}) are not "
                         "supported")
    pairs, fused, ranks = {}, {}, [int(config["r"])]
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
        # PEFT nests a wrapper per targeted parameter of one module (`.base_layer`).
        plain = module.replace(".base_layer", "")
        pair = (a, _partner(name, tensors, key.replace(".lora_A.", ".lora_B.")))
        if config.get("target_parameters") and plain.endswith(".experts"):
            fused.setdefault(plain, []).append(pair)  # scaled once their parameter is known
        else:
            rank, scale = _peft_rank_and_scale(config, plain)
            pairs[module] = (pair[0], pair[1] * scale)
            ranks.append(rank)
    _check_all_paired(name, tensors, len(pairs) + sum(map(len, fused.values())),
                      (".lora_A.weight", ".lora_B.weight"))
    for module, found in fused.items():
        expert_pairs = fused_expert_pairs(name, module, found, config["target_parameters"],
                                          partial(_peft_rank_and_scale, config))
        pairs.update(expert_pairs)
        ranks += [a.shape[1] for a, _ in expert_pairs.values()]
    return LoraAdapter(name, max(ranks), config.get("base_model_name_or_path"),
                       stacked_per_expert(name, pairs))


def _peft_rank_and_scale(config: dict, module: str) -> tuple[int, float]:
    """Module `module`'s rank and scale: the config's `r` and `lora_alpha`, or those of the
    first `rank_pattern` / `alpha_pattern` key naming its end, as PEFT picks them."""
    rank = int(_pattern_value(config.get("rank_pattern"), module, config["r"]))
    alpha = float(_pattern_value(config.get("alpha_pattern"), module,
                                 config.get("lora_alpha", config["r"])))
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _pattern_value(patterns: dict | None, module: str, default):
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _mlx_lm_adapter(name: str, config: dict, tensors: dict[str, np.ndarray]) -> LoraAdapter:
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
        # A linear's: a [in, r], b [r, out]; a SwitchLinear's: a [experts, r, in], b
        # [experts, out, r], as served.
        pairs[module] = (a, b * scale) if a.ndim == 3 else (a.T, b.T * scale)
    _check_all_paired(name, tensors, len(pairs), (".lora_a", ".lora_b"))
    return LoraAdapter(name, rank, config.get("model"), pairs)


def _partner(name: str, tensors: dict[str, np.ndarray], key: str) -> np.ndarray:
    if key not in tensors:
        raise ValueError(f"adapter {name!r}: {key} is missing (each A needs its B)")
    return tensors[key]


def _check_all_paired(name: str, tensors: dict[str, np.ndarray], num_pairs: int,
                      suffixes: tuple[str, str]) -> None:
    """Every tensor is one of a pair; an unknown one (quantized LoRA, a saved module) is
    refused rather than ignored."""
    stray = sorted(k for k in tensors if not k.endswith(suffixes))
    if stray or len(tensors) != 2 * num_pairs:
        raise ValueError(f"adapter {name!r}: tensors that are not LoRA pairs: "
                         f"{', '.join(stray[:5]) or 'a B without its A'}")
    if not num_pairs:
        raise ValueError(f"adapter {name!r}: no LoRA weights in its safetensors file")
