"""The check every GGUF family's conversion ends with: the converted dir is the Hugging Face
model it was written from, in config and in transformers' logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
from tiny_models import VOCAB

from convert.validate import probe_ids, prompt_logits, validate_conversion
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.weights import load_model


def assert_converts_to(reference: Path, source: Path, out: Path) -> ModelConfig:
    """`out`, converted from the GGUF `source`, against the Hugging Face dir `reference`:
    the same config (the GGUF's tokenizer, borrowed from the default model, names its own
    special tokens), transformers' logits to 1e-4 and no validation error. Returns the
    converted config."""
    from transformers import AutoModelForCausalLM

    ours = ModelConfig.from_dict(json.loads((out / "config.json").read_text()))
    theirs = ModelConfig.from_dict(json.loads((reference / "config.json").read_text()))
    assert dataclasses.replace(ours, bos_token_id=theirs.bos_token_id,
                               eos_token_ids=theirs.eos_token_ids) == theirs
    ids = probe_ids(VOCAB) * 5  # 40 tokens: every expert is chosen
    model = AutoModelForCausalLM.from_pretrained(reference, attn_implementation="eager").float()
    with torch.no_grad():
        expected_logits = model(torch.tensor([ids])).logits[0].numpy()
    got_logits = prompt_logits(load_model(out, mx.float32), ids)
    np.testing.assert_allclose(got_logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert validate_conversion(source, out).relative_error == 0.0
    return ours
