"""Tiny random-weight checkpoints of every supported family, saved by transformers.

Each config switches on what sets its family apart (biases, q/k norms, soft-capping, fused
projections, partial rotary) plus a rope kind and, where the family has one, a sliding window
much shorter than the test prompts. A text model with no causal-LM class of its own (Muse
Glimmer's, Qwen3-VL's) is saved inside its multimodal model, with a tiny vision tower the
conversion leaves out; `build_tiny_model(..., vision=True)` saves any vision-language family
so, for tests that feed images.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models

VOCAB = 128
WINDOW = 8
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    # No end-of-sequence token: transformers' `generate` would mask it out, the engine would not.
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    attn_implementation="eager",
)
# Multimodal rope over 8 frequency pairs (head_dim 16): 2 turn by time, 3 by height, 3 by width.
MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
             mrope_interleaved=True)
# Sparse-attention (DSA) families' shape: MLA with a q low rank, experts, an indexer.
DSA_SHAPE = dict(
    num_hidden_layers=3, num_key_value_heads=4, head_dim=8, q_lora_rank=24, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
    num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1,
    first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    index_topk=8, index_head_dim=16, index_n_heads=16)
# model_type -> (transformers config class, model class, config overrides)
TINY_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=32))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=WINDOW + 3, max_window_layers=1,
        max_position_embeddings=128,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=32))),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_key_value_heads=1, rope_parameters=dict(rope_type="linear", rope_theta=1e4,
                                                    factor=2.0))),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=1.0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_key_value_heads=4, sliding_window=2 * WINDOW, original_max_position_embeddings=128,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, factor=2.0,
                             partial_rotary_factor=0.5, short_factor=[1.0, 1.1, 1.2, 1.5],
                             long_factor=[2.0, 3.0, 4.0, 5.0]))),
    # MoE: few experts and a k > 1, so every prompt spreads over all of them.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    # q and k normed across all heads, half of each head turned (the legacy `rotary_dim`),
    # sigmoid routing with the block's correction bias.
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        num_local_experts=6, num_experts_per_tok=2, rotary_dim=8)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1])),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             partial_rotary_factor=0.5))),
    # Multi-head latent attention (q through its own low rank, DeepSeek's paired rope dims)
    # over experts routed by group, after a dense layer.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, head_dim=8, q_lora_rank=24, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        num_mtp_layers=0, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                             mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=64))),
    # GLM-4.7-Flash: DeepSeek V3's layers, its dense ones listed by kind; no q low rank.
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, head_dim=8, q_lora_rank=None,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        n_shared_experts=1, mlp_layer_types=["dense", "sparse", "dense"],
        routed_scaling_factor=1.8)),
    # Mistral 4: DeepSeek V3's layers routed by a softmax over groups, rope halves not
    # interleaved, and queries scaled past a short pretraining length (every 16 positions).
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, head_dim=32, q_lora_rank=24,
        kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        rope_interleave=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                             mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=16, llama_4_scaling_beta=0.1))),
    # DeepSeek sparse attention: DeepSeek V3's layers, each query attending only to the 8
    # keys its indexer scores best (prompts run past 8). 16 index heads: a score is exactly 0
    # (a tie) only where every head's relu is, rarely enough not to sit at a boundary.
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        DSA_SHAPE, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                        mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0,
                                        beta_slow=1.0, original_max_position_embeddings=64))),
    # GLM-5: the same with its index rope dims paired, the middle layer reusing the first's
    # choice of keys.
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        DSA_SHAPE, indexer_types=["full", "shared", "full"], routed_scaling_factor=1.8)),
    # Laguna: a query head count per layer, a softplus gate per head, sliding and full layers
    # each with its rope (YaRN on half the full heads), soft-capped sigmoid routing with a
    # correction bias and scaled weights, a shared expert, dense layers listed by kind.
    "laguna": ("LagunaConfig", "LagunaForCausalLM", dict(
        num_hidden_layers=4, attention_bias=True, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        num_attention_heads_per_layer=[4, 2, 6, 4], num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_layer_types=["dense", "sparse", "sparse", "dense"], moe_routed_scaling_factor=2.5,
        moe_router_logit_softcapping=2.0,
        rope_parameters={"full_attention": dict(rope_type="yarn", rope_theta=500000.0,
                                                factor=4.0, partial_rotary_factor=0.5,
                                                original_max_position_embeddings=32),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})),
    # Muse Glimmer (text): NoPE full layers among rope sliding ones, biases, a scaled q.
    "muse_glimmer_text": ("MuseGlimmerTextConfig", "MuseGlimmerForConditionalGeneration", dict(
        num_hidden_layers=5, sliding_window=WINDOW, attention_bias=True, qk_scale_factor=2.5,
        output_multiplier=0.5, final_logit_softcapping=3.0, post_norm_eps=1e-3,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    # Windows shorter than the prompts on the sliding layers; sinks are random parameters.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=64))),
    # Every Gemma 4 layer kind: full layers with their own head size and KV heads attending
    # over their keys as values, the last two layers reading K/V of earlier ones (with
    # double-wide MLPs), per-layer embeddings, and experts beside each MLP.
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_hidden_layers=5, sliding_window=WINDOW, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        use_double_wide_mlp=True, final_logit_softcapping=30.0,
        rope_parameters={"full_attention": dict(rope_type="proportional", rope_theta=1e6,
                                                partial_rotary_factor=0.25),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
    # Linear-attention (Gated DeltaNet) layers around gated full attention.
    # A quarter of each 32-wide head turns: 4 frequency pairs, one per rope axis and a time one.
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "full_attention"],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[2, 1, 1], mrope_interleaved=True))),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_hidden_layers=3, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 0], mrope_interleaved=True))),
    # Qwen3.5-MoE's layout with fused linear-attention projections and a dense MLP layer.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=3, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[2],
        layer_types=["linear_attention", "full_attention", "linear_attention"])),
    # Qwen3-VL's text models (saved in their multimodal models): Qwen3's and Qwen3-MoE's
    # layers turned by a multimodal rope.
    "qwen3_vl_text": ("Qwen3VLTextConfig", "Qwen3VLForConditionalGeneration", dict(
        rope_parameters=MROPE)),
    "qwen3_vl_moe_text": ("Qwen3VLMoeTextConfig", "Qwen3VLMoeForConditionalGeneration", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[1], rope_parameters=MROPE)),
}


# Image tokens inside the tiny vocabulary; a 2 x 2 patch merge.
IMAGE_TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122,
                    vision_end_token_id=123)
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2,
                   spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                   num_position_embeddings=16)
# Gemma's image tokens inside the tiny vocabulary (boi, the placeholder, eoi).
GEMMA_IMAGE_TOKENS = dict(image_token_id=120, boi_token_id=121, eoi_token_id=122)
# SigLIP over 32 x 32 pixels in 4 x 4 patches, pooled to 16 tokens an image: longer than the
# text model's window, so the window cuts into an image's bidirectional attention.
GEMMA3_VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=4,
                     vision_use_head=False)
GEMMA3_TOKENS = dict(image_token_index=120, boi_token_index=121, eoi_token_index=122,
                     mm_tokens_per_image=16)
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, patch_size=4,
                     pooling_kernel_size=2, position_embedding_size=64)
# text model_type -> (multimodal config class, its model class, vision config, image token
# settings) of the vision-language families whose text models take image features.
VISION_LANGUAGE = {
    "qwen3_vl_text": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                      dict(QWEN_VISION, deepstack_visual_indexes=[0, 1]), IMAGE_TOKENS),
    "qwen3_vl_moe_text": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                          dict(QWEN_VISION, deepstack_visual_indexes=[0, 1]), IMAGE_TOKENS),
    "qwen3_5_text": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", QWEN_VISION,
                     IMAGE_TOKENS),
    "qwen3_5_moe_text": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", QWEN_VISION,
                         IMAGE_TOKENS),
    "gemma3_text": ("Gemma3Config", "Gemma3ForConditionalGeneration", GEMMA3_VISION,
                    GEMMA3_TOKENS),
    # Its sliding layers let an image's tokens see each other (the larger Gemma 4s').
    "gemma4_text": ("Gemma4Config", "Gemma4ForConditionalGeneration", GEMMA4_VISION,
                    dict(GEMMA_IMAGE_TOKENS, audio_config=None)),
}
# Text config fields a family's vision-language checkpoint sets.
VISION_TEXT_OVERRIDES = {"gemma4_text": dict(use_bidirectional_attention="vision")}


def _vision_language_config(model_type: str, text):
    config_class, _, vision, tokens = VISION_LANGUAGE[model_type]
    return getattr(transformers, config_class)(text_config=text.to_dict(), vision_config=vision,
                                               **tokens)


# model_type -> the multimodal config its tiny text config is saved in (vision kept tiny).
MULTIMODAL = {
    "qwen3_vl_text": partial(_vision_language_config, "qwen3_vl_text"),
    "qwen3_vl_moe_text": partial(_vision_language_config, "qwen3_vl_moe_text"),
    "muse_glimmer_text": lambda text: transformers.MuseGlimmerConfig(
        text_config=text.to_dict(), out_hidden_size=128, projector_hidden_size=32,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, patch_size=2, pos_emb_height=4,
                           pos_emb_width=4)),
}


def build_tiny_model(model_type: str, path: Path, vision: bool = False, **extra):
    """Save a tiny random `model_type` checkpoint (+ a word-level tokenizer) into `path` and
    return the float32 PyTorch model. `vision`: saved in its vision-language model
    (`VISION_LANGUAGE`). `extra`: config fields over the family's."""
    config_class, model_class, overrides = TINY_MODELS[model_type]
    torch.manual_seed(0)
    own = VISION_TEXT_OVERRIDES.get(model_type, {}) if vision else {}
    config = getattr(transformers, config_class)(**{**COMMON, **overrides, **own, **extra})
    wrap = partial(_vision_language_config, model_type) if vision else MULTIMODAL.get(model_type)
    if wrap is not None:
        config = wrap(config)
        config._attn_implementation = COMMON["attn_implementation"]
    if vision:
        model_class = VISION_LANGUAGE[model_type][1]
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        # Move norms off 1 (or 0) and biases off 0, so a misread one cannot go unnoticed.
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM's choice-only router bias
                buffer.add_(0.5 * torch.randn_like(buffer))
    model.save_pretrained(path, safe_serialization=True)
    save_word_tokenizer(path)
    return model


def save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer of the tiny vocabulary (`w0` .. `w127`) into `path`."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(path / "tokenizer.json"))


def hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation of one prompt: the reference for served tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()
