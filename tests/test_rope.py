"""Rotary embeddings of every supported kind against transformers' for the same config."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from kernels_metal.metadata import AttentionMetadata
from kernels_metal.reference import apply_rope
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.rope import RotaryEmbedding
from metal_engine.models.rope_parameters import RopeParameters

SHAPE = dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=64,
             intermediate_size=64, max_position_embeddings=64)
LLAMA_ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                    "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
}
LAYER_TYPES = ["sliding_attention", "full_attention"]
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.2, 2.5, 3.0, 3.5],
            "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 9.0, 12.0, 16.0]}


def hf_tables(rotary, length: int, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """transformers' cos/sin for positions 0..length-1, first half of the features."""
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1), torch.arange(length)[None], **kwargs)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy(), sin[0, :, :half].numpy()


def our_tables(params: RopeParameters, config: ModelConfig, length: int):
    """Our cos/sin for one request whose context after the step is `length`."""
    rope = RotaryEmbedding(params, config.head_dim, config.max_position_embeddings)
    meta = AttentionMetadata(np.array([0, length], np.int32), np.array([length], np.int32),
                             np.zeros((1, 1), np.int32), np.zeros(length, np.int64), 16)
    cos, sin = rope.tables(mx.arange(length), meta)
    return np.array(cos[:, 0]), np.array(sin[:, 0])


def assert_tables_match(ours, theirs) -> None:
    for got, want in zip(ours, theirs, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", LLAMA_ROPES)
@pytest.mark.parametrize("length", [40, 200])  # within and beyond max_position_embeddings
def test_llama_rope_kinds_match_transformers(kind, length):
    hf_config = LlamaConfig(**SHAPE, rope_parameters={"rope_theta": 5000.0, **LLAMA_ROPES[kind]})
    config = ModelConfig.from_dict(hf_config.to_dict())
    assert config.rope.rope_type == LLAMA_ROPES[kind]["rope_type"]
    expected = hf_tables(LlamaRotaryEmbedding(hf_config), length)
    assert_tables_match(our_tables(config.rope, config, length), expected)


@pytest.mark.parametrize("length", [30, 100])  # up to, then past the pretraining length
def test_longrope_with_partial_rotary_matches_transformers(length):
    hf_config = Phi3Config(**SHAPE, original_max_position_embeddings=32, rope_parameters={
        "rope_theta": 10000.0, "partial_rotary_factor": 0.5, **LONGROPE})
    config = ModelConfig.from_dict(hf_config.to_dict())
    ours = our_tables(config.rope, config, length)
    assert ours[0].shape[-1] == 8  # 16 of head_dim 32 rotate
    assert_tables_match(ours, hf_tables(Phi3RotaryEmbedding(hf_config), length))


def test_gemma3_local_and_global_ropes_match_transformers():
    hf_config = Gemma3TextConfig(**SHAPE, head_dim=32, layer_types=LAYER_TYPES, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    config = ModelConfig.from_dict(hf_config.to_dict())
    rotary = Gemma3RotaryEmbedding(hf_config)
    for layer_type in ("full_attention", "sliding_attention"):
        expected = hf_tables(rotary, 50, layer_type=layer_type)
        assert_tables_match(our_tables(config.rope_for(layer_type), config, 50), expected)


def test_old_style_rope_keys_read_like_transformers_5():
    """rope_theta + rope_scaling (with `type`) and rope_parameters give the same rope."""
    old = {**SHAPE, "model_type": "llama", "rope_theta": 5000.0,
           "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}
    new = LlamaConfig(**SHAPE, rope_parameters={"rope_theta": 5000.0,
                                                **LLAMA_ROPES["llama3"]}).to_dict()
    assert ModelConfig.from_dict(old).rope == ModelConfig.from_dict(new).rope
    gemma_old = {**SHAPE, "model_type": "gemma3_text", "rope_theta": 1e6,
                 "rope_local_base_freq": 1e4,
                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    gemma_new = Gemma3TextConfig(**SHAPE, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}).to_dict()
    for layer_type in ("full_attention", "sliding_attention"):
        assert (ModelConfig.from_dict(gemma_old).rope_for(layer_type)
                == ModelConfig.from_dict(gemma_new).rope_for(layer_type))


def test_unsupported_rope_kind_is_named():
    with pytest.raises(ValueError, match="'mrope' is not supported; supported: default, linear"):
        ModelConfig.from_dict({**SHAPE, "model_type": "qwen2",
                               "rope_scaling": {"type": "mrope", "mrope_section": [2, 2]}})


def test_partial_rotary_leaves_the_tail_untouched():
    x = mx.random.normal((5, 2, 32))
    cos, sin = mx.cos(mx.ones((5, 1, 8))), mx.sin(mx.ones((5, 1, 8)))
    rotated = apply_rope(x, cos, sin)
    np.testing.assert_array_equal(np.array(rotated[..., 16:]), np.array(x[..., 16:]))
    assert not np.allclose(np.array(rotated[..., :16]), np.array(x[..., :16]))


def test_context_dependent_rope_follows_each_request_of_a_packed_step():
    """Dynamic NTK: rows of a long and a short request batched together get their own tables."""
    hf_config = LlamaConfig(**SHAPE, rope_parameters={"rope_theta": 5000.0,
                                                      **LLAMA_ROPES["dynamic"]})
    config = ModelConfig.from_dict(hf_config.to_dict())
    rope = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
    # Request 0: rows at positions 197..199 of 200; request 1: rows 0..29 of 30.
    meta = AttentionMetadata(np.array([0, 3, 33], np.int32), np.array([200, 30], np.int32),
                             np.zeros((2, 1), np.int32), np.zeros(33, np.int64), 16)
    positions = mx.array(np.r_[197:200, 0:30])
    cos, sin = (np.array(t[:, 0]) for t in rope.tables(positions, meta))
    long_cos, long_sin = hf_tables(LlamaRotaryEmbedding(hf_config), 200)
    short_cos, short_sin = hf_tables(LlamaRotaryEmbedding(hf_config), 30)
    assert_tables_match((cos[:3], sin[:3]), (long_cos[197:], long_sin[197:]))
    assert_tables_match((cos[3:], sin[3:]), (short_cos, short_sin))
