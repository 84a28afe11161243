"""MLX quantization as mlx-lm writes it: affine, and the mxfp4 that GPT-OSS's experts ship in.

config.json holds `quantization: {"group_size", "bits", "mode"}` (mlx-lm repeats it as
`quantization_config`), optionally with per-module entries: a module path mapped to its own
`{"group_size", "bits", "mode"}` (an entry without a mode is affine, as mlx-lm reads it), or to
`false` when that module stays in float. Each quantized Linear, Embedding or expert stack stores
`weight` (uint32, packed) and `scales`, plus `biases` in affine mode, as `mx.quantize` returns
them: mxfp4's scales are uint8 E8M0 exponents, one per 32 FP4 (e2m1) values, no biases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
Mode = Literal["affine", "mxfp4"]
MODES: tuple[Mode, ...] = ("affine", "mxfp4")
_TOP_LEVEL_KEYS = ("group_size", "bits", "mode")


@dataclass(frozen=True)
class QuantParams:
    group_size: int
    bits: int
    mode: Mode = "affine"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"quantization mode {self.mode!r} is not supported; metal-serve "
                             f"reads MLX's {' and '.join(map(repr, MODES))} modes")
        if self.mode == "mxfp4" and (self.group_size, self.bits) != (32, 4):
            raise ValueError(f"mxfp4 quantization has group size 32 and 4 bits, not "
                             f"{self.group_size} and {self.bits}")
        if self.bits not in BITS:
            raise ValueError(f"quantization bits {self.bits} are not supported; choose one of "
                             f"{', '.join(map(str, BITS))}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"quantization group size {self.group_size} is not supported; "
                             f"choose one of {', '.join(map(str, GROUP_SIZES))}")

    def to_dict(self) -> dict[str, int | str]:
        """`to_quantized`'s arguments, and the config entry mlx-lm writes (no mode if affine)."""
        entry: dict[str, int | str] = {"group_size": self.group_size, "bits": self.bits}
        return entry if self.mode == "affine" else {**entry, "mode": self.mode}

    def packed_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The shapes `mx.quantize` gives a float weight of `shape`, by tensor kind."""
        *outer, width = shape
        groups = (*outer, width // self.group_size)
        shapes = {"weight": (*outer, width * self.bits // 32), "scales": groups}
        return shapes if self.mode != "affine" else {**shapes, "biases": groups}


MXFP4 = QuantParams(32, 4, "mxfp4")


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
        default = QuantParams(entries["group_size"], entries["bits"],
                              entries.get("mode", "affine"))
        modules: dict[str, QuantParams | bool] = {}
        for path, entry in entries.items():
            if path in _TOP_LEVEL_KEYS:
                continue
            if isinstance(entry, bool):
                modules[path] = entry
            elif isinstance(entry, dict):
                modules[path] = QuantParams(entry.get("group_size", default.group_size),
                                            entry.get("bits", default.bits),
                                            entry.get("mode", "affine"))
            else:
                raise ValueError(f"quantization entry {path!r} is {entry!r}; mlx-lm writes a "
                                 "{group_size, bits, mode} dict or false there")
        return cls(default, modules)

    def params_for(self, module_path: str) -> QuantParams:
        entry = self.modules.get(module_path, True)
        return entry if isinstance(entry, QuantParams) else self.default


def dequantize_weights(weights: dict[str, mx.array],
                       quantization: QuantizationConfig) -> dict[str, mx.array]:
    """Replace each module's (weight, scales[, biases]) with its float weight."""
    floats = {}
    for name, value in weights.items():
        module, _, kind = name.rpartition(".")
        if kind in ("scales", "biases") and f"{module}.scales" in weights:
            continue
        if kind == "weight" and f"{module}.scales" in weights:
            value = dequantize(value, weights[f"{module}.scales"],
                               weights.get(f"{module}.biases"), quantization.params_for(module))
        floats[name] = value
    return floats


def dequantize(weight: mx.array, scales: mx.array, biases: mx.array | None,
               params: QuantParams) -> mx.array:
    """The float weight; mxfp4 in float32, which holds every FP4 value times its exponent
    exactly (mx.dequantize's default for it is bfloat16)."""
    dtype = None if params.mode == "affine" else mx.float32
    return mx.dequantize(weight, scales, biases, params.group_size, params.bits,
                         mode=params.mode, dtype=dtype)


def _mlx_quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """`quantization_config` when it is mlx-lm's copy; a foreign scheme is refused."""
    entries = config.get("quantization_config")
    if not entries:
        return None
    method = entries.get("quant_method")
    if method == "mxfp4":
        raise ValueError(
            "this is a Hugging Face MXFP4 checkpoint (GPT-OSS as OpenAI publishes it); convert "
            "it first with `metal-serve convert DIR --out OUT` (its experts stay MXFP4)"
        )
    if method == "fp8":
        raise ValueError(
            "this is a block-quantized FP8 checkpoint (DeepSeek's, Kimi's); convert it first "
            "with `metal-serve convert DIR --out OUT` (its weights are dequantized, and "
            "`--quantize 4` or `8` makes them MLX's)"
        )
    if method is not None:
        raise ValueError(
            f"this checkpoint is quantized with {method!r}, which metal-serve cannot read; use "
            "the float checkpoint (and `metal-serve convert --quantize 4`) or an MLX "
            "(mlx-community) quantized one"
        )
    return entries
