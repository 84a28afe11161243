"""The check that transformers reads a converted model dir's config.json as the engine does.

transformers 5's AutoConfig validates the rope keys (a `rope_scaling` beside per-layer-type
`rope_parameters` can make it refuse the whole dir), and the engine's tokenizer load goes
through it; tools built on transformers read the rope from what it standardizes.
"""

from __future__ import annotations

from pathlib import Path

from metal_engine.loading.model_config import ModelConfig


def assert_transformers_reads_the_same_rope(model_dir: Path, source: Path | None = None) -> None:
    """AutoConfig loads `model_dir` and, per attention layer type, finds the engine's rope kind,
    theta and rotary share; with `source`, also exactly the rope it finds in the source dir."""
    from transformers import AutoConfig

    theirs = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    if source is not None:
        original = AutoConfig.from_pretrained(source, trust_remote_code=False)
        original = getattr(original, "text_config", original)  # a multimodal checkpoint
        assert theirs.rope_parameters == original.rope_parameters
    ours = ModelConfig.from_model_dir(model_dir)
    params = theirs.rope_parameters
    for layer_type in set(ours.layer_types) - {"linear_attention"} or {"full_attention"}:
        hf = params[layer_type] if "full_attention" in params else params
        rope = ours.rope_for(layer_type)
        assert hf["rope_type"] == rope.rope_type, layer_type
        assert hf["rope_theta"] == rope.rope_theta, layer_type
        assert hf.get("partial_rotary_factor", 1.0) == rope.partial_rotary_factor, layer_type
        assert hf.get("factor") == rope.factor, layer_type
