"""The model runner: the only place tensors live. Launches one packed step at a time."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from metal_engine.block_tables import BlockTables
from metal_engine.input_batch import StepInputs, build_step_inputs
from metal_engine.kv_cache import KVCache
from metal_engine.models.decoder import CausalLM
from metal_engine.sampler import SamplingBatch, sample
from scheduler.scheduler import SchedulerOutput


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; `sampled()` waits for its tokens."""

    out: SchedulerOutput
    sample_request_ids: list[str]
    token_ids: mx.array | None  # [len(sample_request_ids)], being computed

    def sampled(self) -> dict[str, int]:
        """The sampled id per sampling request (blocks until the device has them)."""
        if self.token_ids is None:
            return {}
        return dict(zip(self.sample_request_ids, self.token_ids.tolist(), strict=True))


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.block_tables = BlockTables()

    def release(self, request_ids: list[str]) -> None:
        """Drop state kept for requests that finished (call with every step's finished ids)."""
        self.block_tables.release(request_ids)

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run the forward for every scheduled token; return the sampled id per sampling request."""
        return self.launch(out).sampled()

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling on the device and return without waiting.

        Tokens the scheduler fed before knowing them (sampled by `previous`, still in flight)
        are taken from `previous`'s device array, so the step can be queued right behind it.
        """
        step = build_step_inputs(out, self.cache.block_size, self.block_tables)
        input_ids = _with_pending_tokens(step, previous)
        hidden = self.model(input_ids, mx.array(step.positions), step.attention, self.cache)
        if not step.sample_request_ids:  # prefill chunks only: just write their K/V
            mx.async_eval(self.cache.arrays())
            return LaunchedStep(out, [], None)
        logits = self.model.logits(hidden[mx.array(step.sample_rows)])
        by_id = {s.request_id: s for s in out.scheduled}
        sampled = [by_id[r] for r in step.sample_request_ids]
        batch = SamplingBatch.build(
            [s.params for s in sampled], [s.num_output_tokens for s in sampled]
        )
        token_ids = sample(logits, batch)
        mx.async_eval(token_ids, self.cache.arrays())
        return LaunchedStep(out, step.sample_request_ids, token_ids)

    def forward_logits(self, out: SchedulerOutput) -> mx.array:
        """Logits of every packed row (for tests and diagnostics, not the serving path)."""
        step = build_step_inputs(out, self.cache.block_size)
        hidden = self.model(
            _with_pending_tokens(step, None), mx.array(step.positions), step.attention, self.cache
        )
        logits = self.model.logits(hidden)
        mx.eval(logits, self.cache.arrays())
        return logits


def _with_pending_tokens(step: StepInputs, previous: LaunchedStep | None) -> mx.array:
    """The step's token ids, pending rows filled from the previous step's sampled array."""
    input_ids = mx.array(step.input_ids)
    if not len(step.pending_rows):
        return input_ids
    if previous is None or previous.token_ids is None:
        raise RuntimeError("a step feeds pending tokens but no launched step samples them")
    sample_index = {r: i for i, r in enumerate(previous.sample_request_ids)}
    source = np.array([sample_index[r] for r in step.pending_request_ids], np.int32)
    input_ids[mx.array(step.pending_rows)] = previous.token_ids[mx.array(source)].astype(
        input_ids.dtype
    )
    return input_ids
