"""Pipeline parallelism: each rank runs a contiguous run of the layers, and a step's hidden
states go from rank to rank over `mx.distributed` send/recv, in micro-batches of its
requests so that rank 0 computes the second while rank 1 computes the first.

    rank 0      embed + its layers, micro-batch by micro-batch, each sent on as done; then
                the sampling rows' final hidden states from the last rank -> logits, sampling
    rank k      each micro-batch from rank k - 1 -> its layers -> on to rank k + 1
    last rank   each micro-batch -> its layers -> final norm, its sampling rows kept; once it
                has them all, one message back to rank 0

Every send goes to the next rank in the ring (the last rank's next is rank 0), and the last
rank answers only after its last micro-batch, so no two ranks ever send to each other at
once: large messages could otherwise fill both directions and stall. Rank 0 keeps the
embedding and the LM head, the last rank the final norm; each rank's KV pools have blocks
only for its layers.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_engine.block_tables import BlockTables
from metal_engine.cache.kv_cache import KVCache
from metal_engine.input_batch import StepInputs, build_step_inputs
from metal_engine.models.decoder import CausalLM, DecoderModel
from metal_engine.parallel.group import RankGroup, evaluate
from metal_engine.parallel.shard import share
from scheduler.output import SchedulerOutput


def stage_layers(num_layers: int, rank: int, size: int) -> range:
    return share(num_layers, rank, size, what="layers")


def keep_stage(model: CausalLM, rank: int, size: int) -> None:
    """Drop the weights rank `rank` does not run, in place (before they are read)."""
    decoder = model.model
    if type(decoder).__call__ is not DecoderModel.__call__:
        raise ValueError(f"pipeline parallelism does not split {model.config.model_type} yet "
                         "(its decoder does more than run its layers): serve it with "
                         "--pipeline-parallel-size 1")
    mine = stage_layers(len(decoder.layers), rank, size)
    decoder.layers = [layer if i in mine else nn.Module() for i, layer in enumerate(decoder.layers)]
    if rank != 0:
        decoder.embed_tokens = nn.Module()
        if "lm_head" in model:
            model.lm_head = nn.Module()
    if rank != size - 1:
        decoder.norm = nn.Module()


def stage_pools(model: CausalLM, rank: int, size: int) -> set[int]:
    """The KV pools the stage's layers write and read."""
    cfg = model.config
    mine = stage_layers(cfg.num_hidden_layers, rank, size)
    return {cfg.kv_pool(i) for i in mine if cfg.layer_type(i) != "linear_attention"}


def micro_batches(out: SchedulerOutput, count: int) -> list[SchedulerOutput]:
    """The step's requests in up to `count` contiguous runs of about equal tokens."""
    scheduled = out.scheduled
    tokens = np.cumsum([len(s.token_ids) for s in scheduled])
    # Each cut falls after the request that reaches its share of the tokens.
    cuts = np.searchsorted(tokens, tokens[-1] * np.arange(1, count) / count) + 1
    edges = sorted({0, *(int(c) for c in cuts), len(scheduled)})
    return [SchedulerOutput(scheduled=scheduled[a:b])
            for a, b in itertools.pairwise(edges) if b > a]


class PipelineStage:
    """One rank's layers of every step."""

    def __init__(self, model: CausalLM, cache: KVCache, group: RankGroup,
                 dtype: mx.Dtype) -> None:
        """`dtype`: the model's, which its hidden states travel in."""
        self.model, self.cache, self.dtype = model, cache, dtype
        self.group, self.rank, self.size = group.group, group.rank, group.size
        self.layers = stage_layers(model.config.num_hidden_layers, self.rank, self.size)

    def run(self, out: SchedulerOutput, step: StepInputs, tables: BlockTables,
            window_tables: BlockTables) -> mx.array | None:
        """This rank's part of the step; on rank 0, the final hidden states of the step's
        sampling rows in order (None elsewhere, and for a step that samples nothing)."""
        states = self.cache.states
        if states is not None:
            states.copy(out.state_plan.restores)
        kept = []
        for batch in micro_batches(out, self.size):
            inputs = build_step_inputs(batch, self.cache.block_size, tables, window_tables)
            if states is not None:
                states.bind(batch.scheduled)
            h = self._stage_input(inputs)
            h = self.model.model.run_layers(h, mx.array(inputs.positions), inputs.attention,
                                            self.cache, self.layers)
            if self.rank == self.size - 1:
                h = self.model.model.norm(h)
                if len(inputs.sample_rows):
                    kept.append(h[mx.array(inputs.sample_rows)])
                evaluate(h, self.cache.arrays())
            else:
                evaluate(mx.distributed.send(h, self.rank + 1, group=self.group))
        if states is not None:
            states.copy(out.state_plan.saves)
        return self._final_rows(step, kept)

    def _stage_input(self, inputs: StepInputs) -> mx.array:
        if self.rank == 0:
            return self.model.model.embed(mx.array(inputs.input_ids))
        shape = (len(inputs.input_ids), self.model.config.hidden_size)
        return evaluate(mx.distributed.recv(shape, self.dtype, self.rank - 1, group=self.group))

    def _final_rows(self, step: StepInputs, kept: list[mx.array]) -> mx.array | None:
        last = self.size - 1
        if not len(step.sample_rows):
            return None
        if self.rank == last:
            evaluate(mx.distributed.send(mx.concatenate(kept), 0, group=self.group))
            return None
        if self.rank != 0:
            return None
        shape = (len(step.sample_rows), self.model.config.hidden_size)
        return evaluate(mx.distributed.recv(shape, self.dtype, last, group=self.group))
