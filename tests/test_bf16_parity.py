"""Families published in bfloat16, run in bfloat16 against transformers in bfloat16.

`--dtype auto` keeps a bfloat16 checkpoint in bfloat16 on an Apple GPU
(metal_engine.loading.model_dtype).
bfloat16 keeps 8 bits of mantissa, so two correct bfloat16 forwards that round in different
places differ by about as much as either differs from float32. The stated tolerance: the
engine's bfloat16 logits are no further from transformers' bfloat16 ones than 2x transformers'
own bfloat16 error (against its float32 logits) plus one bfloat16 ulp of the largest logit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from engine_helpers import make_runner_and_scheduler
from test_model_parity import random_ids, run_logits
from tiny_models import build_tiny_model

from convert import convert_model

# Published in bfloat16 (Llama 3, Qwen3, Qwen3.5, Gemma 2 and 3). The MoE families (Qwen3-MoE,
# GPT-OSS, Gemma 4's experts) run their experts in host loops on the CPU backend, which are
# float32 only; their bfloat16 graph runs on an Apple GPU.
BFLOAT16_FAMILIES = ("llama", "qwen3", "qwen3_5_text", "gemma2", "gemma3_text")
ULP = 2.0**-7  # bfloat16's spacing just below 2 (tiny random models' logits stay under 2)


def _engine_logits(path, ids: list[int], chunk: int) -> np.ndarray:
    runner, scheduler = make_runner_and_scheduler(path, block_size=16, dtype=mx.bfloat16)
    assert runner.model.model.embed_tokens.weight.dtype == mx.bfloat16
    return run_logits(runner, scheduler, "a", ids, chunk)


def _torch_logits(model, ids: list[int], dtype: torch.dtype) -> np.ndarray:
    with torch.no_grad():
        return model.to(dtype)(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("family", BFLOAT16_FAMILIES)
@pytest.mark.parametrize("chunk", [45, 7], ids=["whole-prompt", "chunked"])
def test_bfloat16_logits_match_transformers_in_bfloat16(family, chunk, tmp_path):
    model = build_tiny_model(family, tmp_path / "hf")
    path = convert_model(tmp_path / "hf", tmp_path / "model", progress=False)
    ids = random_ids(chunk, 45)
    exact = _torch_logits(model, ids, torch.float32)
    reference = _torch_logits(model, ids, torch.bfloat16)
    got = _engine_logits(path, ids, chunk)
    reference_error = np.abs(reference - exact).max()
    assert np.abs(got - reference).max() <= 2 * reference_error + ULP
