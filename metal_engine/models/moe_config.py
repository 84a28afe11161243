"""Mixture-of-experts settings read from a Hugging Face config, and written back.

Each family names the same things differently (Mixtral `num_local_experts`, Qwen3-MoE
`num_experts`, GLM-4.5 `n_routed_experts`); they read into one MoeConfig. Router variants this
engine does not implement are refused by the config field that selects them, so a checkpoint
is never served with the wrong routing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

Scoring = Literal["softmax", "sigmoid"]
# config field -> the values this engine routes as the family's reference code does.
_ROUTER_FIELDS = {
    "glm4_moe": {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)},
    "deepseek_v3": {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)},
    "glm4_moe_lite": {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)},
    "deepseek_v32": {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)},
    "glm_moe_dsa": {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)},
    "mistral4": {},  # its router always takes a softmax; transformers reads no variant field
    "minimax_m2": {"scoring_func": ("sigmoid",), "use_routing_bias": (True,)},
    "laguna": {"moe_router_score_func": ("sigmoid",), "moe_apply_router_weight_on_input": (False,)},
    "qwen3_moe": {"scoring_func": ("softmax",)},
    "qwen3_vl_moe_text": {},
    "mixtral": {"scoring_func": ("softmax",)},
    "gpt_oss": {"scoring_func": ("softmax",)},
    "gemma4_text": {},
    "qwen3_5_moe_text": {},
    "qwen3_next": {},
}


@dataclass(frozen=True)
class MoeConfig:
    """How a token picks experts, and which layers have them.

    Routing: `scoring` turns router logits (soft-capped at ±`router_logit_softcapping` where
    set) into scores (softmax over all experts, or an independent sigmoid each); the top
    `experts_per_token` are chosen (for sigmoid scoring with `score_correction_bias` added, and
    only among the best `groups_per_token` of `num_groups` groups); their scores become the
    weights, renormalized to sum 1 when `normalize_top_k`, then times `routed_scaling_factor`.
    """

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    scoring: Scoring = "softmax"
    normalize_top_k: bool = False
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    groups_per_token: int = 1
    score_correction_bias: bool = False  # GLM: a learned bias added for the choice only
    shared_intermediate_size: int = 0  # width of the always-on shared expert; 0: none
    shared_expert_gate: bool = False  # Qwen: the shared expert's output times a sigmoid gate
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP
    # GPT-OSS's clamped SwiGLU: `(clip(up, ±limit) + 1) * g * sigmoid(alpha * g)`,
    # g = min(gate, limit). None: the config's hidden_act.
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    router_logit_softcapping: float | None = None  # Laguna: `cap * tanh(logits / cap)`

    def __post_init__(self) -> None:
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.experts_per_token}) must be between 1 "
                             f"and the number of experts ({self.num_experts})")
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_group ({self.num_groups}) must divide the number of experts "
                             f"({self.num_experts})")
        if not 1 <= self.groups_per_token <= self.num_groups:
            raise ValueError(f"topk_group ({self.groups_per_token}) must be between 1 and "
                             f"n_group ({self.num_groups})")
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and self.groups_per_token * per_group < self.experts_per_token:
            raise ValueError(f"topk_group ({self.groups_per_token}) groups of {per_group} "
                             f"experts hold fewer than num_experts_per_tok "
                             f"({self.experts_per_token})")

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def to_hf(self, model_type: str) -> dict[str, Any]:
        """The family's own config.json keys for these settings."""
        if model_type in ("qwen3_5_moe_text", "qwen3_next"):
            return {"num_experts": self.num_experts, "num_experts_per_tok": self.experts_per_token,
                    "moe_intermediate_size": self.expert_intermediate_size,
                    "shared_expert_intermediate_size": self.shared_intermediate_size,
                    "norm_topk_prob": self.normalize_top_k, "decoder_sparse_step": 1,
                    "mlp_only_layers": list(self.dense_layers)}  # fmt: skip
        if model_type == "laguna":
            return {"num_experts": self.num_experts, "num_experts_per_tok": self.experts_per_token,
                    "moe_intermediate_size": self.expert_intermediate_size,
                    "shared_expert_intermediate_size": self.shared_intermediate_size,
                    "moe_routed_scaling_factor": self.routed_scaling_factor,
                    "moe_router_logit_softcapping": self.router_logit_softcapping or 0.0}
        if model_type == "gemma4_text":
            return {"enable_moe_block": True, "num_experts": self.num_experts,
                    "top_k_experts": self.experts_per_token,
                    "moe_intermediate_size": self.expert_intermediate_size}
        common = {"num_experts_per_tok": self.experts_per_token}
        if model_type == "gpt_oss":
            return {**common, "num_local_experts": self.num_experts,
                    "swiglu_alpha": self.swiglu_alpha, "swiglu_limit": self.swiglu_limit}
        if model_type in ("mixtral", "minimax_m2"):
            return {**common, "num_local_experts": self.num_experts}
        if model_type in ("qwen3_moe", "qwen3_vl_moe_text"):
            return {**common, "num_experts": self.num_experts,
                    "moe_intermediate_size": self.expert_intermediate_size,
                    "norm_topk_prob": self.normalize_top_k, "decoder_sparse_step": 1,
                    "mlp_only_layers": list(self.dense_layers)}  # fmt: skip
        dense = len(self.dense_layers)
        return {**common, "n_routed_experts": self.num_experts,
                "moe_intermediate_size": self.expert_intermediate_size,
                "norm_topk_prob": self.normalize_top_k,
                "routed_scaling_factor": self.routed_scaling_factor,
                "n_group": self.num_groups, "topk_group": self.groups_per_token,
                "n_shared_experts": self.shared_intermediate_size // self.expert_intermediate_size,
                "first_k_dense_replace": dense}  # fmt: skip


def read_moe(cfg: dict[str, Any]) -> MoeConfig | None:
    """The MoE settings of a config.json (None for a dense family)."""
    reader = _READERS.get(cfg["model_type"])
    if reader is None:
        return None
    _check_router(cfg)
    return reader(cfg)


def _mixtral(cfg: dict[str, Any]) -> MoeConfig:
    return MoeConfig(
        num_experts=_required(cfg, "num_local_experts"),
        experts_per_token=_experts_per_token(cfg),
        expert_intermediate_size=cfg["intermediate_size"],
        normalize_top_k=True,
    )


def _gpt_oss(cfg: dict[str, Any]) -> MoeConfig:
    return MoeConfig(
        num_experts=_required(cfg, "num_local_experts"),
        experts_per_token=_experts_per_token(cfg),
        expert_intermediate_size=cfg["intermediate_size"],
        normalize_top_k=True,  # its softmax over the top-k logits is the same thing
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )


def _minimax_m2(cfg: dict[str, Any]) -> MoeConfig:
    """Sigmoid scores, a correction bias for the choice only, the top k renormalized."""
    return MoeConfig(
        num_experts=_required(cfg, "num_local_experts"),
        experts_per_token=_experts_per_token(cfg),
        expert_intermediate_size=cfg["intermediate_size"],
        scoring="sigmoid",
        normalize_top_k=True,
        score_correction_bias=True,
    )


def _qwen3_moe(cfg: dict[str, Any]) -> MoeConfig:
    return MoeConfig(
        num_experts=cfg.get("num_experts") or _required(cfg, "num_local_experts"),
        experts_per_token=_experts_per_token(cfg),
        expert_intermediate_size=_required(cfg, "moe_intermediate_size"),
        normalize_top_k=bool(cfg.get("norm_topk_prob", False)),
        dense_layers=_qwen_dense_layers(cfg, cfg["num_hidden_layers"]),
    )


def _qwen3_vl_moe(cfg: dict[str, Any]) -> MoeConfig:
    """Qwen3-MoE's experts, the top k always renormalized (transformers reads no
    norm_topk_prob for Qwen3-VL-MoE)."""
    return replace(_qwen3_moe(cfg), normalize_top_k=True)


def _qwen_hybrid(cfg: dict[str, Any]) -> MoeConfig:
    """Qwen3.5-MoE and Qwen3-Next: top-k renormalized, a sigmoid-gated shared expert."""
    return MoeConfig(
        num_experts=_required(cfg, "num_experts"),
        experts_per_token=_experts_per_token(cfg),
        expert_intermediate_size=_required(cfg, "moe_intermediate_size"),
        normalize_top_k=bool(cfg.get("norm_topk_prob", True)),
        shared_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
        shared_expert_gate=True,
        dense_layers=_qwen_dense_layers(cfg, cfg["num_hidden_layers"]),
    )


def _glm4_moe(cfg: dict[str, Any]) -> MoeConfig:
    """GLM-4.5's experts, routed as DeepSeek V3's are (the same keys)."""
    expert_size = _required(cfg, "moe_intermediate_size")
    return MoeConfig(
        num_experts=cfg.get("n_routed_experts") or _required(cfg, "num_local_experts"),
        experts_per_token=_experts_per_token(cfg),
        expert_intermediate_size=expert_size,
        scoring="sigmoid",
        normalize_top_k=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        num_groups=cfg.get("n_group", 1),
        groups_per_token=cfg.get("topk_group", 1),
        score_correction_bias=True,
        shared_intermediate_size=expert_size * cfg.get("n_shared_experts", 1),
        dense_layers=_glm_dense_layers(cfg),
    )


def _mistral4(cfg: dict[str, Any]) -> MoeConfig:
    """DeepSeek V3's keys, scored by a softmax with no correction bias."""
    return replace(_glm4_moe(cfg), scoring="softmax", score_correction_bias=False)


def _laguna(cfg: dict[str, Any]) -> MoeConfig:
    """Sigmoid scores of (optionally soft-capped) logits with a choice-only correction bias,
    the top k renormalized then scaled, a shared expert; dense layers listed by kind."""
    return MoeConfig(
        num_experts=_required(cfg, "num_experts"),
        experts_per_token=_experts_per_token(cfg),
        expert_intermediate_size=_required(cfg, "moe_intermediate_size"),
        scoring="sigmoid",
        normalize_top_k=True,
        routed_scaling_factor=float(cfg.get("moe_routed_scaling_factor", 1.0)),
        score_correction_bias=True,
        shared_intermediate_size=cfg["shared_expert_intermediate_size"],
        dense_layers=_glm_dense_layers(cfg),
        router_logit_softcapping=cfg.get("moe_router_logit_softcapping") or None,
    )


def _glm_dense_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """The first `first_k_dense_replace` layers, or the `mlp_layer_types` list (GLM-4.7-Flash,
    Laguna)."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is not None:
        return tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    return tuple(range(min(cfg.get("first_k_dense_replace", 1), cfg["num_hidden_layers"])))


def _gemma4(cfg: dict[str, Any]) -> MoeConfig | None:
    """Experts beside every layer's MLP, when the config enables them."""
    if not cfg.get("enable_moe_block"):
        return None
    return MoeConfig(
        num_experts=_required(cfg, "num_experts"),
        experts_per_token=_required(cfg, "top_k_experts"),
        expert_intermediate_size=_required(cfg, "moe_intermediate_size"),
        normalize_top_k=True,
    )


_READERS: dict[str, Callable[[dict[str, Any]], MoeConfig | None]] = {
    "mixtral": _mixtral, "gpt_oss": _gpt_oss, "qwen3_moe": _qwen3_moe, "glm4_moe": _glm4_moe,
    "minimax_m2": _minimax_m2, "laguna": _laguna, "qwen3_vl_moe_text": _qwen3_vl_moe,
    "deepseek_v3": _glm4_moe, "glm4_moe_lite": _glm4_moe, "mistral4": _mistral4,
    "deepseek_v32": _glm4_moe, "glm_moe_dsa": _glm4_moe,
    "gemma4_text": _gemma4, "qwen3_5_moe_text": _qwen_hybrid, "qwen3_next": _qwen_hybrid,
}  # fmt: skip


def _qwen_dense_layers(cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Qwen's layers without experts: `mlp_only_layers`, and those off `decoder_sparse_step`."""
    step = cfg.get("decoder_sparse_step") or 1
    dense = set(cfg.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % step}
    return tuple(sorted(dense))


def _check_router(cfg: dict[str, Any]) -> None:
    for key, supported in _ROUTER_FIELDS[cfg["model_type"]].items():
        if key in cfg and cfg[key] not in supported:
            raise ValueError(
                f"config.json sets {key}={cfg[key]!r}: this {cfg['model_type']} router variant "
                f"is not supported (supported: {', '.join(map(repr, supported))})"
            )


def _experts_per_token(cfg: dict[str, Any]) -> int:
    # The original GPT-OSS config says experts_per_token.
    return cfg.get("num_experts_per_tok") or _required(cfg, "experts_per_token")


def _required(cfg: dict[str, Any], key: str) -> int:
    if not cfg.get(key):
        raise ValueError(f"config.json of a {cfg['model_type']} model lacks {key}")
    return cfg[key]
