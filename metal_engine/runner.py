"""The model runner: the only place tensors live. Executes one packed step."""

from __future__ import annotations

import mlx.core as mx

from metal_engine.input_batch import build_step_inputs
from metal_engine.kv_cache import KVCache
from metal_engine.models.llama import Model
from metal_engine.sampler import SamplingBatch, sample
from scheduler.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: Model, cache: KVCache) -> None:
        self.model = model
        self.cache = cache

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run the forward for every scheduled token; return the sampled id per sampling request."""
        step = build_step_inputs(out, self.cache.block_size)
        hidden = self.model(
            mx.array(step.input_ids), mx.array(step.positions), step.attention, self.cache
        )
        if not step.sample_request_ids:
            mx.eval(self.cache.arrays())  # prefill chunks only: just write their K/V
            return {}
        logits = self.model.logits(hidden[mx.array(step.sample_rows)])
        by_id = {s.request_id: s for s in out.scheduled}
        sampled = [by_id[r] for r in step.sample_request_ids]
        batch = SamplingBatch.build(
            [s.params for s in sampled], [s.num_output_tokens for s in sampled]
        )
        token_ids = sample(logits, batch)
        mx.eval(token_ids, self.cache.arrays())
        return dict(zip(step.sample_request_ids, token_ids.tolist(), strict=True))

    def forward_logits(self, out: SchedulerOutput) -> mx.array:
        """Logits of every packed row (for tests and diagnostics, not the serving path)."""
        step = build_step_inputs(out, self.cache.block_size)
        hidden = self.model(
            mx.array(step.input_ids), mx.array(step.positions), step.attention, self.cache
        )
        logits = self.model.logits(hidden)
        mx.eval(logits, self.cache.arrays())
        return logits
