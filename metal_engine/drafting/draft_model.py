"""The draft model of speculative decoding: a smaller model of the same tokenizer that drafts
each decoding request's next k tokens on the device, inside the step that verifies them.

Its K/V live in pools of its own indexed by the target's block ids and slots, so the prefix
cache, preemption and freeing need nothing of their own: a block holds both models' K/V for
its tokens. To keep them in step, the draft computes every position the target computes:

    pass 0    every scheduled row but the drafts (prefill chunks, decodes, each drafting
              request's last token); samples d1 at each drafting request's last row
    pass j    each request with k >= j feeds d_j at its position and samples d_{j+1};
              pass k only writes d_k's K/V, which the next step reads if all are accepted

Drafts are drawn from q = softmax(logits / T) (the argmax where T is 0) with noise of their
own (`draw_drafts`), and q goes to the rejection sampler. The passes are one lazy graph with
the target's forward: nothing waits for the host in between.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import mlx.core as mx
import numpy as np

from metal_engine.block_tables import BlockTables
from metal_engine.cache.kv_cache import KVCache
from metal_engine.input_batch import build_step_inputs
from metal_engine.models.decoder import CausalLM
from metal_engine.sampling.rejection_sampler import DraftBatch, draw_drafts
from scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    from scheduler.media import PromptMedia


class Drafts(NamedTuple):
    token_ids: mx.array  # [D] in DraftBatch order: by request, then position
    probs: mx.array  # [D, V] the distribution each was drawn from


class DraftModel:
    def __init__(self, model: CausalLM, cache: KVCache) -> None:
        self.model = model
        self.cache = cache

    def draft(self, out: SchedulerOutput, input_ids: mx.array, draft_rows: np.ndarray,
              batch: DraftBatch | None, tables: BlockTables, window_tables: BlockTables,
              media: Mapping[str, PromptMedia]) -> Drafts | None:
        """Run the passes over the step's rows (`input_ids`, the target's, with the draft
        rows still placeholders at `draft_rows`); return the drafts, or None when the step
        has none (pass 0 still writes the draft's K/V of every row). A draft model never
        sees a prompt's images (`media`): its positions are the tokens' indices."""
        block_size = self.cache.block_size
        counts = {s.request_id: len(s.draft_token_ids) for s in out.scheduled}
        first = SchedulerOutput([
            replace(s, token_ids=s.token_ids[: len(s.token_ids) - counts[s.request_id]],
                    draft_token_ids=[], samples=counts[s.request_id] > 0)
            for s in out.scheduled])
        keep = np.setdiff1d(np.arange(input_ids.shape[0]), draft_rows)
        step = build_step_inputs(first, block_size, tables, window_tables)
        hidden = self.model(input_ids[mx.array(keep)], mx.array(step.positions),
                            step.attention, self.cache)
        if batch is None:
            return None
        drafting = [s for s in first.scheduled if s.samples]
        num_drafts = [counts[s.request_id] for s in drafting]
        starts = batch.row_starts[batch.num_draft_tokens > 0]  # the drafting requests' rows
        temperatures = batch.sampling.temperature[starts]
        seeds = [batch.sampling.seeds[row] for row in starts]
        logits = self.model.logits(hidden[mx.array(step.sample_rows)])
        tokens, probs = draw_drafts(logits, temperatures, seeds)
        drawn, dists = [tokens], [probs]
        where = draw_index(num_drafts)
        for j in range(1, max(num_drafts) + 1):
            live = [i for i, k in enumerate(num_drafts) if k >= j]
            items = SchedulerOutput([
                replace(drafting[i], token_ids=[0], samples=j < num_drafts[i],
                        start_position=drafting[i].start_position + len(drafting[i].token_ids)
                        + j - 1)
                for i in live])
            step = build_step_inputs(items, block_size, tables, window_tables)
            ids = mx.concatenate(drawn)[mx.array(where[live, j - 1])]
            hidden = self.model(ids, mx.array(step.positions), step.attention, self.cache)
            sampling = [i for i in live if j < num_drafts[i]]
            if not sampling:
                break
            logits = self.model.logits(hidden[mx.array(step.sample_rows)])
            tokens, probs = draw_drafts(logits, temperatures[sampling],
                                        [batch.sampling.seeds[starts[i] + j] for i in sampling])
            drawn.append(tokens)
            dists.append(probs)
        order = mx.array(where[where >= 0])  # row-major: by request, then position
        return Drafts(mx.concatenate(drawn)[order], mx.concatenate(dists)[order])


    def follow(self, out: SchedulerOutput, input_ids: mx.array, hidden: mx.array,
               tables: BlockTables, window_tables: BlockTables,
               media: Mapping[str, PromptMedia]) -> None:
        """Nothing after the target's forward: the draft's K/V come from the tokens alone."""

    def release(self, request_ids: list[str]) -> None:
        """Nothing kept per request."""


def draw_index(num_drafts: list[int]) -> np.ndarray:
    """`[R, K]`: where draft j + 1 of drafting request i sits in the concatenation of the
    passes' draws (pass j drew one token per request with more than j drafts), -1 past its
    drafts."""
    counts = np.array(num_drafts)
    where = np.full((len(counts), counts.max()), -1, np.int64)
    base = 0
    for j in range(counts.max()):
        live = np.flatnonzero(counts > j)
        where[live, j] = base + np.arange(len(live))
        base += len(live)
    return where


def load_draft_model(path: Path, dtype: mx.Dtype, target: CausalLM,
                     target_tokenizer) -> CausalLM:
    """The draft model of `--speculative-config`'s "model", checked to draft for `target`:
    the same tokenizer and vocabulary, and only full-attention layers (its K/V share the
    target's block tables; a window or a recurrent state would need groups of their own)."""
    from metal_engine.loading.tokenizer_loading import load_tokenizer
    from metal_engine.loading.weights import load_model

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"--speculative-config: the draft model {str(path)!r} is not a model "
                         "directory (no config.json); convert it with `metal-serve convert`")
    draft = load_model(path, dtype)
    cfg = draft.config
    if cfg.vocab_size != target.config.vocab_size:
        raise ValueError(f"--speculative-config: the draft model's vocabulary has "
                         f"{cfg.vocab_size} tokens, the served model's {target.config.vocab_size}:"
                         " use a draft of the same family and tokenizer")
    if load_tokenizer(path).get_vocab() != target_tokenizer.get_vocab():
        raise ValueError("--speculative-config: the draft model's tokenizer differs from the "
                         "served model's: use a draft of the same family and tokenizer")
    if cfg.linear_attention is not None or cfg.sliding_window is not None:
        raise ValueError("--speculative-config: the draft model must have only full-attention "
                         "layers (no sliding window, no linear attention)")
    return draft
