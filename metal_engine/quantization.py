"""MLX affine quantization as mlx-lm writes it.

config.json holds `quantization: {"group_size", "bits"}` (mlx-lm repeats it as
`quantization_config`), optionally with per-module entries: a module path mapped to its own
`{"group_size", "bits"}`, or to `false` when that module stays in float. Each quantized Linear
or Embedding stores `weight` (uint32, packed), `scales` and `biases`, as `mx.quantize` returns
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
_TOP_LEVEL_KEYS = ("group_size", "bits", "mode")


@dataclass(frozen=True)
class QuantParams:
    group_size: int
    bits: int

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"quantization bits {self.bits} are not supported; choose one of "
                             f"{', '.join(map(str, BITS))}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"quantization group size {self.group_size} is not supported; "
                             f"choose one of {', '.join(map(str, GROUP_SIZES))}")

    def to_dict(self) -> dict[str, int]:
        return {"group_size": self.group_size, "bits": self.bits}


@dataclass(frozen=True)
class QuantizationConfig:
    """The checkpoint-wide params plus mlx-lm's per-module entries (params, or False: float)."""

    default: QuantParams
    modules: dict[str, QuantParams | bool] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig | None:
        """Read a config.json; None for a float checkpoint. Other quantization schemes
        (GPTQ, AWQ, bitsandbytes, ...) raise ValueError: their weights cannot be read here."""
        entries = config.get("quantization") or _mlx_quantization_config(config)
        if entries is None:
            return None
        _check_mode(entries, "the checkpoint")
        default = QuantParams(entries["group_size"], entries["bits"])
        modules: dict[str, QuantParams | bool] = {}
        for path, entry in entries.items():
            if path in _TOP_LEVEL_KEYS:
                continue
            if isinstance(entry, bool):
                modules[path] = entry
            elif isinstance(entry, dict):
                _check_mode(entry, path)
                modules[path] = QuantParams(entry.get("group_size", default.group_size),
                                            entry.get("bits", default.bits))
            else:
                raise ValueError(f"quantization entry {path!r} is {entry!r}; mlx-lm writes a "
                                 "{group_size, bits} dict or false there")
        return cls(default, modules)

    def params_for(self, module_path: str) -> QuantParams:
        entry = self.modules.get(module_path, True)
        return entry if isinstance(entry, QuantParams) else self.default


def dequantize_weights(weights: dict[str, mx.array],
                       quantization: QuantizationConfig) -> dict[str, mx.array]:
    """Replace each module's (weight, scales, biases) with its float weight."""
    floats = {}
    for name, value in weights.items():
        module, _, kind = name.rpartition(".")
        if kind in ("scales", "biases") and f"{module}.scales" in weights:
            continue
        if kind == "weight" and f"{module}.scales" in weights:
            params = quantization.params_for(module)
            value = mx.dequantize(value, weights[f"{module}.scales"],
                                  weights[f"{module}.biases"], params.group_size, params.bits)
        floats[name] = value
    return floats


def _mlx_quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """`quantization_config` when it is mlx-lm's copy; a foreign scheme is refused."""
    entries = config.get("quantization_config")
    if not entries:
        return None
    method = entries.get("quant_method")
    if method is not None:
        raise ValueError(
            f"this checkpoint is quantized with {method!r}, which metal-serve cannot read; use "
            "the float checkpoint (and `metal-serve convert --quantize 4`) or an MLX "
            "(mlx-community) quantized one"
        )
    return entries


def _check_mode(entries: dict[str, Any], where: str) -> None:
    mode = entries.get("mode", "affine")
    if mode != "affine":
        raise ValueError(f"{where} uses quantization mode {mode!r}; metal-serve reads only "
                         "MLX affine quantization (mode 'affine')")
