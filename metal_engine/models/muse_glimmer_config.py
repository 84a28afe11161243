"""What only Muse Glimmer's text model has, read from its config (the `text_config` of its
multimodal checkpoint, or a `muse_glimmer_text` config.json) and written back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# What transformers assumes for keys a Muse Glimmer text config leaves out.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128, "rms_norm_eps": 1e-5, "sliding_window": 2048,
    "final_logit_softcapping": 20.0, "hidden_activation": "silu", "qk_scale_factor": 3.87,
    "output_multiplier": 0.19611613513818404, "post_norm_eps": 1e-8,
}  # fmt: skip


@dataclass(frozen=True)
class MuseGlimmerOptions:
    """`qk_scale_factor`: q's factor after its (scaleless) norm; `output_multiplier`: the
    logits' factor before soft-capping; `post_norm_eps`: the eps of the norms after attention
    and MLP; `nope_layers`: the layers whose attention has no rope."""

    qk_scale_factor: float
    output_multiplier: float
    post_norm_eps: float
    nope_layers: tuple[int, ...]

    def rotary(self, layer: int) -> bool:
        return layer not in self.nope_layers

    def to_hf(self, rope_theta: float, num_layers: int) -> dict[str, Any]:
        return {"qk_scale_factor": self.qk_scale_factor,
                "output_multiplier": self.output_multiplier,
                "post_norm_eps": self.post_norm_eps,
                "layer_rope_theta": [0 if i in self.nope_layers else rope_theta
                                     for i in range(num_layers)]}  # fmt: skip


def read_muse_glimmer(cfg: dict[str, Any], rope_theta: float) -> MuseGlimmerOptions:
    return MuseGlimmerOptions(
        qk_scale_factor=float(cfg["qk_scale_factor"]),
        output_multiplier=float(cfg["output_multiplier"]),
        post_norm_eps=float(cfg["post_norm_eps"]),
        nope_layers=_nope_layers(cfg, rope_theta),
    )


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """transformers' rule: the `_every_fourth_from_last` layers are full, the rest slide."""
    full = _every_fourth_from_last(num_layers)
    return tuple("full_attention" if i in full else "sliding_attention" for i in range(num_layers))


def _every_fourth_from_last(num_layers: int) -> tuple[int, ...]:
    return tuple(i for i in range(num_layers) if (num_layers - 1 - i) % 4 == 0)


def _nope_layers(cfg: dict[str, Any], rope_theta: float) -> tuple[int, ...]:
    """The layers `layer_rope_theta` gives theta 0 (by default every 4th counted back from the
    last). transformers turns every other layer by the one rope_theta, whatever theta it is
    listed with: a list naming another theta is refused rather than read two ways."""
    thetas = cfg.get("layer_rope_theta")
    if thetas is None:
        return _every_fourth_from_last(cfg["num_hidden_layers"])
    other = [(i, t) for i, t in enumerate(thetas) if t and t != rope_theta]
    if other:
        layer, theta = other[0]
        raise ValueError(f"config.json's layer_rope_theta gives layer {layer} theta {theta}: "
                         f"a rope theta per layer is not supported (rope_theta is {rope_theta})")
    return tuple(i for i, theta in enumerate(thetas) if not theta)
