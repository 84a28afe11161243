"""ModelConfig reads every family's config.json as transformers does, and writes it back."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
import transformers
from tiny_models import COMMON, TINY_MODELS

from metal_engine.loading.families import SUPPORTED_MODEL_TYPES
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.weights import load_model
from metal_engine.models.encoder_config import ENCODERS
from metal_engine.models.registry import MODEL_CLASSES

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def hf_config(config_class: str, **overrides) -> dict:
    return getattr(transformers, config_class)(**{**SHAPE, **overrides}).to_dict()


def test_every_supported_family_has_a_model_class_and_a_parity_case():
    # The encoders' parity cases pool (tests/test_encoders.py); the decoders' generate.
    assert set(SUPPORTED_MODEL_TYPES) == set(MODEL_CLASSES) == set(TINY_MODELS) | set(ENCODERS)


@pytest.mark.parametrize(("config_class", "overrides", "sliding"), [
    ("LlamaConfig", {}, []),
    ("MistralConfig", {"sliding_window": 16}, list(range(7))),
    ("MistralConfig", {"sliding_window": None}, []),
    ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 4},
     [4, 5, 6]),
    ("Qwen3Config", {"use_sliding_window": False, "sliding_window": 16}, []),
    ("Gemma2Config", {"sliding_window": 16}, [0, 2, 4, 6]),
    ("Gemma3TextConfig", {"sliding_window": 16}, [0, 1, 2, 3, 4, 6]),
    ("Phi3Config", {"sliding_window": 16}, list(range(7))),
])
def test_sliding_layers_are_the_ones_transformers_slides(config_class, overrides, sliding):
    config = ModelConfig.from_dict(hf_config(config_class, **overrides))
    windows = [config.window(i) for i in range(7)]
    assert [i for i, w in enumerate(windows) if w is not None] == sliding
    assert {w for w in windows if w is not None} <= {16}


def test_keys_a_gemma2_config_leaves_out_get_transformers_defaults():
    shape = {k: v for k, v in SHAPE.items() if k != "head_dim"}
    config = ModelConfig.from_dict({**shape, "model_type": "gemma2"})
    assert (config.head_dim, config.query_pre_attn_scalar) == (256, 256)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh"
    assert config.window(0) == 4096 and config.window(1) is None


def test_minimax_m2_rotary_dim_is_the_rotated_share_of_a_head():
    """MiniMax M2's released configs give the rotated width as `rotary_dim`, and leave the
    rope theta to the family's default."""
    raw = {**SHAPE, "rotary_dim": 4, "num_local_experts": 4, "num_experts_per_tok": 2}
    hf = transformers.MiniMaxM2Config(**raw).rope_parameters
    config = ModelConfig.from_dict({**raw, "model_type": "minimax_m2"})
    assert config.rope.partial_rotary_factor == hf["partial_rotary_factor"] == 0.5
    assert config.rope.rope_theta == hf["rope_theta"] == 5e6


def test_a_laguna_gate_setting_read_two_ways_is_refused():
    """transformers reads `gating: false` as a gate per element, mlx-lm as no gate."""
    config_class, _, overrides = TINY_MODELS["laguna"]
    raw = {**hf_config(config_class, **{**COMMON, **overrides}), "gating": False}
    with pytest.raises(ValueError, match="gating=False"):
        ModelConfig.from_dict(raw)


def test_keys_a_muse_glimmer_config_leaves_out_get_transformers_defaults():
    hf = transformers.MuseGlimmerTextConfig(**SHAPE)
    config = ModelConfig.from_dict({**SHAPE, "model_type": "muse_glimmer_text"})
    assert config.layer_types == tuple(hf.layer_types)
    nope = [not config.muse_glimmer.rotary(i) for i in range(SHAPE["num_hidden_layers"])]
    assert nope == [theta == 0 for theta in hf.layer_rope_theta]
    assert (config.sliding_window, config.final_logit_softcapping, config.rms_norm_eps) == (
        hf.sliding_window, hf.final_logit_softcapping, hf.rms_norm_eps)
    assert config.muse_glimmer.post_norm_eps == hf.post_norm_eps


def test_a_muse_glimmer_rope_theta_of_its_own_per_layer_is_refused():
    """transformers turns every rope layer by rope_theta, whatever theta a layer lists."""
    config_class, _, overrides = TINY_MODELS["muse_glimmer_text"]
    raw = hf_config(config_class, **{**COMMON, **overrides})
    raw["layer_rope_theta"] = [0, 5e5, 1e4, 1e4, 0]
    with pytest.raises(ValueError, match="layer_rope_theta gives layer 1 theta 500000.0"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("model_type", list(TINY_MODELS))
def test_written_config_reads_back_the_same(model_type):
    config_class, _, overrides = TINY_MODELS[model_type]
    config = ModelConfig.from_dict(hf_config(config_class, **{**COMMON, **overrides}))
    assert ModelConfig.from_dict(config.to_hf_dict()) == config


def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "model_type": "gpt2"}))
    supported = "llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3"
    with pytest.raises(ValueError, match=f"'gpt2' is not supported; supported: {supported}"):
        load_model(tmp_path, mx.float32)


def test_bad_shapes_are_refused_with_the_value():
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple"):
        ModelConfig.from_dict({**SHAPE, "model_type": "llama", "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="activation 'relu' is not supported"):
        ModelConfig.from_dict({**SHAPE, "model_type": "llama", "hidden_act": "relu"})
    with pytest.raises(ValueError, match="lacks required keys: vocab_size"):
        ModelConfig.from_dict({k: v for k, v in SHAPE.items() if k != "vocab_size"})
