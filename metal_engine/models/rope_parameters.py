"""Rotary embedding settings read from a Hugging Face config (transformers 4 and 5 styles).

transformers 5 writes `rope_parameters` (with `rope_theta` inside, and for Gemma 3 one dict
per layer type); older configs write `rope_theta` plus an optional `rope_scaling` dict whose
kind is under `type` or `rope_type`. Both read into the same RopeParameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

RopeType = Literal["default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional"]
ROPE_TYPES: tuple[str, ...] = get_args(RopeType)

# Keys each kind needs besides rope_theta (original_max_position_embeddings has a fallback).
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
# Kinds that scale relative to the pretraining context length.
_NEED_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeParameters:
    """One rotary embedding; field names are transformers' `rope_parameters` keys."""

    rope_type: RopeType = "default"
    rope_theta: float = 10000.0
    # Share of head_dim that rotates: the first features (Phi-3 family), or for the
    # proportional kind the fastest frequencies over the whole head (Gemma 4).
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None  # llama3, yarn, longrope
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool | None = None  # yarn
    attention_factor: float | None = None  # yarn, longrope: cos/sin scale
    short_factor: tuple[float, ...] | None = None  # longrope, contexts up to the original
    long_factor: tuple[float, ...] | None = None  # longrope, longer contexts
    # Mistral 4: queries scaled up with the position's multiple of the pretraining length
    # (Llama 4's attention temperature, models/mistral4.py); not a rope of its own.
    llama_4_scaling_beta: float | None = None
    # Multimodal rope (Qwen3-VL, Qwen3.5): how many frequencies turn by each axis of a 3-D
    # position (time, height, width), interleaved (see models/rope.py `mrope_axes`).
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool | None = None  # kept as read: Qwen3-VL and Qwen3.5 interleave anyway

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        required = _REQUIRED.get(self.rope_type, ())
        if self.rope_type in _NEED_ORIGINAL_LENGTH:
            required += ("original_max_position_embeddings",)
        missing = [k for k in required if getattr(self, k) is None]
        if missing:
            raise ValueError(f"{self.rope_type} rope scaling needs {', '.join(missing)} in the "
                             "config's rope_parameters (or rope_scaling)")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(
                f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.mrope_section is not None and len(self.mrope_section) != 3:
            raise ValueError(f"mrope_section must list 3 counts (time, height, width), got "
                             f"{list(self.mrope_section)}")

    def to_hf(self) -> dict[str, Any]:
        """The `rope_parameters` dict transformers 5 reads (unset keys left out)."""
        params = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if params["partial_rotary_factor"] == 1.0:
            del params["partial_rotary_factor"]
        for key in ("short_factor", "long_factor", "mrope_section"):
            if key in params:
                params[key] = list(params[key])
        return params


def read_rope(cfg: dict[str, Any], params: dict[str, Any] | None, theta: float) -> RopeParameters:
    """RopeParameters from one rope dict (`rope_parameters`, one layer type's entry of it, or
    `rope_scaling`) of config `cfg`; `theta` applies where the dict has no `rope_theta`."""
    params = dict(params or {})
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if cfg.get("model_type") == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # what transformers reads old Phi-3 "su"/"yarn" configs as
    fields = {f.name for f in dataclasses.fields(RopeParameters)} - {"rope_type"}
    values = {k: v for k, v in params.items() if k in fields and v is not None}
    values.setdefault("rope_theta", theta)
    values.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)
    if kind in _NEED_ORIGINAL_LENGTH:
        # Phi-3 keeps the pretraining length at the top level, and transformers prefers it there.
        values["original_max_position_embeddings"] = int(
            cfg.get("original_max_position_embeddings")
            or values.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings", 2048)
        )
    for key in ("short_factor", "long_factor", "mrope_section"):
        if key in values:
            values[key] = tuple(values[key])
    return RopeParameters(rope_type=kind, **values)


def read_rope_theta(cfg: dict[str, Any]) -> float:
    """transformers 5 writes `rope_parameters.rope_theta`, older configs `rope_theta`."""
    if cfg.get("rope_theta") is not None:
        return float(cfg["rope_theta"])
    return float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
