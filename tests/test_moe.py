"""The shared MoE layer: routing against transformers' own routers, gathered experts against
the one-expert-at-a-time loop (in token order and sorted by expert), quantized experts, and
the MoE config fields read, written back and refused."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers
from tiny_models import COMMON, TINY_MODELS

from kernels_metal.cpu.ops import HostOps
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.moe import SORT_PAIRS, SwitchGLU, route
from metal_engine.models.moe_config import MoeConfig, read_moe

HIDDEN, INNER = 32, 64


def _hf_config(model_type: str) -> dict:
    config_class, _, overrides = TINY_MODELS[model_type]
    config = getattr(transformers, config_class)(**{**COMMON, **overrides})
    return {**config.to_dict(), "model_type": model_type}


# model_type -> the transformers router class its MoE blocks use
ROUTERS = {
    "mixtral": "mixtral.modeling_mixtral.MixtralTopKRouter",
    "qwen3_moe": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
    "glm4_moe": "glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter",
    "mistral4": "mistral4.modeling_mistral4.Mistral4TopkRouter",
    "minimax_m2": "minimax_m2.modeling_minimax_m2.MiniMaxM2TopKRouter",
    "laguna": "laguna.modeling_laguna.LagunaTopKRouter",
}
# Routers handed the correction bias by their block, which holds it.
BIAS_FROM_BLOCK = ("minimax_m2",)
# Routers whose block, not the router, scales the routed output by routed_scaling_factor.
SCALED_BY_BLOCK = ("laguna",)


@pytest.mark.parametrize("model_type", list(ROUTERS))
def test_routing_matches_transformers_router(model_type):
    hf = _hf_config(model_type)
    module, name = ROUTERS[model_type].rsplit(".", 1)
    config_class = getattr(transformers, TINY_MODELS[model_type][0])
    router = getattr(__import__(f"transformers.models.{module}", fromlist=[name]), name)(
        config_class(**{**COMMON, **TINY_MODELS[model_type][2]}))
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0, 0.5)
    correction = getattr(router, "e_score_correction_bias", None)
    block_bias = ()
    if model_type in BIAS_FROM_BLOCK:
        correction = 0.5 * torch.randn(router.weight.shape[0])
        block_bias = (correction,)
    x = torch.randn(40, COMMON["hidden_size"])
    with torch.no_grad():
        _, want_weights, want_experts = router(x, *block_bias)
    moe = read_moe(hf)
    if model_type in SCALED_BY_BLOCK:
        want_weights = want_weights * moe.routed_scaling_factor
    logits = mx.array(x.numpy()) @ mx.array(router.weight.detach().numpy()).T
    weights, experts = route(logits, moe, None if correction is None
                             else mx.array(correction.numpy()))  # fmt: skip
    got = _by_expert(np.array(weights), np.array(experts))
    want = _by_expert(want_weights.numpy(), want_experts.numpy())
    np.testing.assert_allclose(got, want, atol=1e-6)


def _by_expert(weights: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """`[rows, experts]` with each row's weights at its chosen experts' columns, 0 elsewhere."""
    weights, experts = weights.astype(np.float32), experts.astype(np.int64)
    dense = np.zeros((weights.shape[0], 16), dtype=np.float32)
    np.put_along_axis(dense, experts, weights, axis=-1)
    return dense


def _moe(**changes) -> MoeConfig:
    return MoeConfig(**{"num_experts": 6, "experts_per_token": 2,
                        "expert_intermediate_size": INNER, **changes})


def _experts(num_experts: int) -> SwitchGLU:
    mx.random.seed(0)
    glu = SwitchGLU(HIDDEN, INNER, num_experts, "silu")
    for proj in (glu.gate_proj, glu.up_proj, glu.down_proj):
        proj.weight = mx.random.normal(proj.weight.shape) * 0.2
    return glu


@pytest.mark.parametrize("rows", [3, SORT_PAIRS], ids=["token-order", "sorted-by-expert"])
def test_gathered_experts_equal_the_grouped_products(rows):
    moe = _moe()
    glu = _experts(moe.num_experts)
    x = mx.random.normal((rows, HIDDEN))
    weights, experts = route(mx.random.normal((rows, moe.num_experts)), moe)
    gathered = (glu(x, experts) * weights[..., None]).sum(axis=-2)
    grouped = HostOps().grouped_experts(glu, x, experts, weights)
    np.testing.assert_allclose(np.array(gathered), np.array(grouped), atol=1e-5)


def test_quantized_experts_equal_their_dequantized_weights():
    glu = _experts(4)
    x = mx.random.normal((SORT_PAIRS, HIDDEN))
    experts = mx.random.randint(0, 4, (SORT_PAIRS, 2)).astype(mx.uint32)
    nn.quantize(glu, group_size=32, bits=4)
    dequantized = _experts(4)
    for name in ("gate_proj", "up_proj", "down_proj"):
        q = glu[name]
        getattr(dequantized, name).weight = mx.dequantize(q.weight, q.scales, q.biases, 32, 4)
    np.testing.assert_allclose(np.array(glu(x, experts)), np.array(dequantized(x, experts)),
                               atol=1e-4)


def test_group_choice_picks_only_from_the_best_groups():
    moe = _moe(num_experts=8, experts_per_token=2, num_groups=4, groups_per_token=1,
               scoring="sigmoid")
    # Group 2 (experts 4, 5) has the best top-2 sum though expert 0 scores highest alone.
    logits = mx.array([[5.0, -5.0, -5.0, -5.0, 3.0, 3.0, -5.0, -5.0]])
    _, experts = route(logits, moe)
    assert sorted(np.array(experts)[0].tolist()) == [4, 5]


@pytest.mark.parametrize("model_type", list(ROUTERS))
def test_moe_fields_survive_writing_config_json(model_type):
    config = ModelConfig.from_dict(_hf_config(model_type))
    assert config.moe is not None
    assert ModelConfig.from_dict(config.to_hf_dict()) == config


def test_layers_the_config_keeps_dense():
    qwen = read_moe({**_hf_config("qwen3_moe"), "num_hidden_layers": 6, "decoder_sparse_step": 2,
                     "mlp_only_layers": [3]})
    assert qwen.dense_layers == (0, 2, 3, 4)
    glm = read_moe({**_hf_config("glm4_moe"), "first_k_dense_replace": 2})
    assert [glm.is_moe_layer(i) for i in range(3)] == [False, False, True]


@pytest.mark.parametrize(("model_type", "field", "value"), [
    ("glm4_moe", "scoring_func", "softmax"),
    ("glm4_moe", "topk_method", "greedy"),
    ("qwen3_moe", "scoring_func", "sigmoid"),
    ("minimax_m2", "scoring_func", "softmax"),
    ("minimax_m2", "use_routing_bias", False),
    ("laguna", "moe_router_score_func", "sqrtsoftplus"),
    ("laguna", "moe_apply_router_weight_on_input", True),
])
def test_unsupported_router_variants_are_refused_by_name(model_type, field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        ModelConfig.from_dict({**_hf_config(model_type), field: value})


def test_inconsistent_expert_counts_are_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**_hf_config("mixtral"), "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="n_group"):
        ModelConfig.from_dict({**_hf_config("glm4_moe"), "n_group": 3})
