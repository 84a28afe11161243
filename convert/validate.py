"""Check a converted model dir: load it as the engine does, run one forward on a few tokens and
compare the logits with the source's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from convert.api import open_source
from convert.fp8_weights import fp8_block
from convert.model_dir import read_manifest
from kernels_metal.kv_quant import KVQuant
from metal_engine.cache.cache_plan import CachePlan
from metal_engine.cache.kv_cache import KVCache
from metal_engine.loading.quantization import QuantizationConfig, dequantize_weights
from metal_engine.loading.weights import load_model
from metal_engine.models.decoder import CausalLM
from metal_engine.models.registry import model_class
from metal_engine.runner import ModelRunner
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

PROBE_TOKENS = 8
BLOCK_SIZE = 16
# Largest relative RMS difference from the float32 source per kind of output, with headroom over
# what the default model shows: float32 1.4e-6, float16 7.7e-4, bfloat16 3.1e-3 (against
# transformers), 8-bit 0.019, 4-bit 0.17 (against itself in float32).
TOLERANCES = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2, 8: 0.05, 4: 0.35}


@dataclass(frozen=True)
class Validation:
    reference: str  # what the logits were compared with
    relative_error: float  # RMS(logits - reference) / RMS(reference)
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.relative_error <= self.tolerance


def validate_conversion(source: Path, out: Path) -> Validation:
    """Compare the probe logits of `out` with those of the local `source` it was converted from.

    The reference is transformers in float32 for a Hugging Face dir whose output is float (when
    transformers and torch are importable), else this engine running the source's tensors in
    float32. Raises ValueError if `out` gives non-finite logits.
    """
    model = load_model(out, mx.float32)
    ids = probe_ids(model.config.vocab_size)
    got = prompt_logits(model, ids)
    if not np.isfinite(got).all():
        raise ValueError(f"{out} gives non-finite logits; the conversion is broken")
    manifest = read_manifest(out) or {}
    quantization = manifest.get("quantization")
    if source.is_dir() and not quantization and _transformers_runs(source):
        reference, expected = "transformers (float32)", _transformers_logits(source, ids)
    else:
        reference, expected = "the source in float32", prompt_logits(_source_model(source), ids)
    tolerance = TOLERANCES[quantization["bits"] if quantization else manifest["dtype"]]
    error = float(np.sqrt(np.mean((got - expected) ** 2) / np.mean(expected**2)))
    return Validation(reference, error, tolerance)


def probe_ids(vocab_size: int) -> list[int]:
    """A few fixed token ids spread over the vocabulary."""
    return [(7919 * i + 11) % vocab_size for i in range(PROBE_TOKENS)]


def prompt_logits(model: CausalLM, ids: list[int], quant: KVQuant | None = None) -> np.ndarray:
    """`[len(ids), vocab]` logits of one prompt, through the engine's packed forward (its K/V
    stored as `quant` says; None: float32)."""
    cfg = model.config
    num_blocks = len(ids) // BLOCK_SIZE + 2
    num_state_slots = 1 if cfg.linear_attention is not None else 0
    cache = KVCache.for_model(cfg, CachePlan(num_blocks, 0, num_state_slots=num_state_slots),
                              BLOCK_SIZE, mx.float32, quant)
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=1,
        max_num_batched_tokens=len(ids), max_model_len=len(ids) + 1,
        enable_prefix_caching=False, num_state_slots=num_state_slots,
    ))
    scheduler.add_request(Request("probe", ids, SamplingParams(max_tokens=1, temperature=0.0)))
    return np.array(ModelRunner(model, cache).forward_logits(scheduler.schedule()))


def _source_model(source: Path) -> CausalLM:
    """The source's tensors in float32 in this engine's model, without writing them anywhere
    (the ones it hands over quantized, dequantized)."""
    opened = open_source(source)
    model = model_class(opened.config.model_type)(opened.config)
    weights = {name: mx.array(t) for name, t in opened.tensors()
               if name not in opened.extra_shapes}
    if opened.quantized:
        packed = QuantizationConfig(next(iter(opened.quantized.values())), opened.quantized)
        weights = dequantize_weights(weights, packed)
    weights = {name: value.astype(mx.float32) for name, value in weights.items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    model.eval()
    return model


def _transformers_runs(source: Path) -> bool:
    """Whether transformers can run the source here: importable, and the source not an FP8
    checkpoint (its FP8 kernels need a GPU)."""
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    return fp8_block(config) is None and _transformers_available()


def _transformers_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _transformers_logits(source: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager",
                                                 trust_remote_code=False).float()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()
