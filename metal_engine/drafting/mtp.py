"""Multi-token prediction (`{"method": "mtp"}`): drafts from the checkpoint's own MTP head.

The head (the family's `mtp_class`, e.g. Qwen3.5's) reads the model's final hidden state h at
position p and the token at p + 1 and predicts the token at p + 2. Its K/V at p are what it
computed there; they sit in a pool of their own, indexed by the model's block ids and slots
like a draft model's, so prefix caching, preemption and freeing need nothing of their own.
Each step, for a request that feeds t[s] at position s (and drafts at s + 1 ...):

    draft passes (before the model)  the head at s - 1 from h[s - 1] (kept from the step
        before) and t[s] samples d1; then, as vLLM's MTP drafters do, the head at
        s + j - 1 from its own output there and d_j samples d_{j+1}
    follow pass (after the model)    the head's K/V at s - 1 ... s + n - 2 from the step's
        inputs t[s] ... t[s + n - 1] and the model's h: every scheduled request, prefill
        chunks included. These overwrite the draft passes' K/V (computed from the head's
        output, not h) and, after a rejection, those written from a rejected draft.

A position's K/V are thus right once the step feeding the token after it has run, and read
only after that. Where h[s - 1] is not kept (a prompt resumed from the prefix cache), the
follow pass starts at s and the request drafts its fed token again, leaving the head's K/V at
s - 1 (those of the request that computed the block) as they are.

The head turns its rows by the positions the model's rows at the same place have: for a
prompt with images (Qwen's multimodal rope), its three-axis positions and past the prompt the
index shifted by the images' delta (metal_engine.vision.step_media.step_positions).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_engine.block_tables import BlockTables
from metal_engine.cache.kv_cache import KVCache
from metal_engine.drafting.draft_model import Drafts, draw_index
from metal_engine.input_batch import build_step_inputs
from metal_engine.loading.model_config import read_config_json
from metal_engine.loading.weights import MTP_PREFIX, safetensors_files, stack_per_expert
from metal_engine.models.decoder import CausalLM
from metal_engine.sampling.rejection_sampler import DraftBatch, draw_drafts
from metal_engine.vision.step_media import step_positions
from scheduler.media import PromptMedia
from scheduler.output import CacheKind, ScheduledRequest, SchedulerOutput
from scheduler.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class _Computed:
    """Rows `[row, row + count)` of a step's `hidden` are one request's positions
    `[start, start + count)`."""

    hidden: mx.array
    row: int
    start: int
    count: int


class MtpDrafter:
    def __init__(self, model: CausalLM, head: nn.Module, cache: KVCache) -> None:
        self.model = model
        self.head = head
        self.cache = cache
        # Per request, the hidden states of its last two steps, newest first. A hybrid
        # model's request recomputes from its last known token after a rejection, and under
        # async scheduling sits out a step behind its drafts, so the position before the one
        # it feeds is always in its last step (or its K/V written already). An attention-only
        # model's (DeepSeek's) goes on under async scheduling: after a rejection it feeds the
        # token after the last accepted one, computed by the step before its last (whose
        # rows past it were drafts rejected since).
        self._computed: dict[str, tuple[_Computed, ...]] = {}

    def draft(self, out: SchedulerOutput, input_ids: mx.array, draft_rows: np.ndarray,
              batch: DraftBatch | None, tables: BlockTables, window_tables: BlockTables,
              media: Mapping[str, PromptMedia]) -> Drafts | None:
        """The drafts of the step's drafting requests (the draft passes); None without any.
        `input_ids`: the step's, pending tokens filled; `media`: the requests' images."""
        if batch is None:
            return None
        first_rows = _first_rows(out)
        drafting = [s for s in out.scheduled if s.samples and s.draft_token_ids]
        starts = batch.row_starts[batch.num_draft_tokens > 0]  # the drafting requests' rows
        fed = input_ids[mx.array([first_rows[s.request_id] for s in drafting])]
        kept = [self._find(s.request_id, s.start_position - 1) for s in drafting]
        seen = [i for i, k in enumerate(kept) if k is not None]
        blind = [i for i, k in enumerate(kept) if k is None]
        parts = []
        if seen:
            parts.append((seen, *self._passes(
                [drafting[i] for i in seen], fed[mx.array(seen)],
                self._gather([kept[i] for i in seen]), batch, starts[seen], tables,
                window_tables, media)))
        if blind:  # the fed token again, a point mass: the head's K/V stay as they are
            index = np.repeat(blind, [len(drafting[i].draft_token_ids) for i in blind])
            tokens = fed[mx.array(index)]
            vocab = mx.arange(self.model.config.vocab_size)
            parts.append((blind, tokens, (vocab[None, :] == tokens[:, None]).astype(mx.float32)))
        return _by_request(parts, [len(s.draft_token_ids) for s in drafting])

    def _passes(self, drafting: list[ScheduledRequest], fed: mx.array, hidden: mx.array,
                batch: DraftBatch, starts: np.ndarray, tables: BlockTables,
                window_tables: BlockTables,
                media: Mapping[str, PromptMedia]) -> tuple[mx.array, mx.array]:
        """The draft passes of requests whose `hidden` state before `fed` is kept: their
        drafts and distributions, by request then position."""
        num_drafts = [len(s.draft_token_ids) for s in drafting]
        temperatures = batch.sampling.temperature[starts]
        live, tokens, drawn, dists = list(range(len(drafting))), fed, [], []
        for j in range(max(num_drafts)):  # pass j samples draft j + 1, at position s - 1 + j
            items = SchedulerOutput([
                replace(drafting[i], token_ids=[0], draft_token_ids=[],
                        start_position=drafting[i].start_position - 1 + j)
                for i in live])
            step = build_step_inputs(items, self.cache.block_size, tables, window_tables)
            positions = step_positions(items.scheduled, media, step.positions)
            out_hidden = self.head(self.model.model.embed(tokens), hidden,
                                   mx.array(positions), step.attention, self.cache)
            drafted, probs = draw_drafts(self.model.logits(out_hidden), temperatures[live],
                                         [batch.sampling.seeds[starts[i] + j] for i in live])
            drawn.append(drafted)
            dists.append(probs)
            going_on = [n for n, i in enumerate(live) if num_drafts[i] > j + 1]
            if not going_on:
                break
            live = [live[n] for n in going_on]
            tokens, hidden = drafted[mx.array(going_on)], out_hidden[mx.array(going_on)]
        where = draw_index(num_drafts)
        order = mx.array(where[where >= 0])
        return mx.concatenate(drawn)[order], mx.concatenate(dists)[order]

    def follow(self, out: SchedulerOutput, input_ids: mx.array, hidden: mx.array,
               tables: BlockTables, window_tables: BlockTables,
               media: Mapping[str, PromptMedia]) -> None:
        """The follow pass over the step's rows (`input_ids` with the drafts filled, `hidden`
        the model's output); keep `hidden` for the steps after."""
        items, token_rows, hidden_rows, kept = [], [], [], []
        total = input_ids.shape[0]
        first_rows = _first_rows(out)
        for s in out.scheduled:
            row, n = first_rows[s.request_id], len(s.token_ids)
            before = self._find(s.request_id, s.start_position - 1)
            if before is not None:  # positions s - 1 ... s + n - 2
                kept.append(before)
                hidden_rows += [total + len(kept) - 1, *range(row, row + n - 1)]
                token_rows += range(row, row + n)
                items.append(_rows(s, s.start_position - 1, n))
            elif n > 1:  # positions s ... s + n - 2
                hidden_rows += range(row, row + n - 1)
                token_rows += range(row + 1, row + n)
                items.append(_rows(s, s.start_position, n - 1))
        for s in out.scheduled:
            last = _Computed(hidden, first_rows[s.request_id], s.start_position,
                             len(s.token_ids))
            self._computed[s.request_id] = (last, *self._computed.get(s.request_id, ())[:1])
        if not items:
            return
        source = mx.concatenate([hidden, self._gather(kept)]) if kept else hidden
        step = build_step_inputs(SchedulerOutput(items), self.cache.block_size, tables,
                                 window_tables)
        positions = step_positions(items, media, step.positions)
        self.head.write_kv(self.model.model.embed(input_ids[mx.array(token_rows)]),
                           source[mx.array(hidden_rows)], mx.array(positions),
                           step.attention, self.cache)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._computed.pop(request_id, None)

    def _find(self, request_id: str, position: int) -> tuple[mx.array, int] | None:
        """(hidden states, row) of `position`, if one of the request's last two steps computed
        it (the newest that did)."""
        for computed in self._computed.get(request_id, ()):
            if computed.start <= position < computed.start + computed.count:
                return computed.hidden, computed.row + position - computed.start
        return None

    @staticmethod
    def _gather(found: list[tuple[mx.array, int]]) -> mx.array:
        """The rows `found` names, one gather per step they come from, in order."""
        groups: dict[int, tuple[mx.array, list[int], list[int]]] = {}
        for i, (hidden, row) in enumerate(found):
            _, rows, order = groups.setdefault(id(hidden), (hidden, [], []))
            rows.append(row)
            order.append(i)
        if len(groups) == 1:
            hidden, rows, _ = next(iter(groups.values()))
            return hidden[mx.array(rows)]
        parts = mx.concatenate([hidden[mx.array(rows)] for hidden, rows, _ in groups.values()])
        order = np.concatenate([order for _, _, order in groups.values()])
        return parts[mx.array(np.argsort(order))]


def _by_request(parts: list[tuple[list[int], mx.array, mx.array]],
                num_drafts: list[int]) -> Drafts:
    """One Drafts, by request then position, from parts that each hold some requests'
    (their indices, drafts by request then position, distributions)."""
    rows: dict[int, np.ndarray] = {}
    offset = 0
    for requests, _, _ in parts:
        for i in requests:
            rows[i] = offset + np.arange(num_drafts[i])
            offset += num_drafts[i]
    order = mx.array(np.concatenate([rows[i] for i in range(len(num_drafts))]))
    return Drafts(mx.concatenate([tokens for _, tokens, _ in parts])[order],
                  mx.concatenate([probs for _, _, probs in parts])[order])


def _first_rows(out: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's first row in the packed step."""
    lengths = [len(s.token_ids) for s in out.scheduled]
    return {s.request_id: int(row) for s, row in
            zip(out.scheduled, np.cumsum([0, *lengths[:-1]]), strict=True)}


def _rows(item: ScheduledRequest, start: int, count: int) -> ScheduledRequest:
    """`count` rows of the request from position `start`, to write K/V only."""
    return replace(item, token_ids=[0] * count, start_position=start, draft_token_ids=[],
                   samples=False)


def with_draft_length(spec: SpeculativeConfig) -> SpeculativeConfig:
    """`spec` with `num_speculative_tokens` set: by default one draft per step, as many as
    the head has layers (vLLM's default)."""
    if spec.num_speculative_tokens is not None:
        return spec
    return replace(spec, num_speculative_tokens=1)


def head_cache(head: nn.Module, kind: CacheKind, num_blocks: int, block_size: int,
               dtype: mx.Dtype) -> KVCache:
    """The head's pool, one block per block of the model's, of the model's `kind` (its layer
    is one of the model's: MLA's keeps latent rows)."""
    return KVCache([head.pool_shape()], num_blocks, block_size, dtype, kind=kind)


def load_mtp_head(path: Path, target: CausalLM, dtype: mx.Dtype) -> nn.Module:
    """The multi-token-prediction head of the model dir `path` (the served model's own, or
    a dir holding its `mtp.*` weights), checked to draft for `target`."""
    cfg = target.config
    head_class = type(target).mtp_class
    if head_class is None:
        raise ValueError(f'--speculative-config: method "mtp" needs a model with a '
                         f"multi-token-prediction head (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, "
                         f"DeepSeek V3, GLM-4.7-Flash); "
                         f"{cfg.model_type} has none: use ngram, suffix or draft_model")
    raw = read_config_json(path)
    num_layers = raw.get("text_config", raw).get("mtp_num_hidden_layers", 0)
    weights = {name.removeprefix(MTP_PREFIX): tensor
               for file in safetensors_files(path) for name, tensor in mx.load(str(file)).items()
               if name.startswith(MTP_PREFIX)}
    if not weights or num_layers < 1:
        raise ValueError(f"--speculative-config: {path} has no multi-token-prediction head "
                         "(no mtp.* weights, or no mtp_num_hidden_layers in config.json); "
                         "convert the original checkpoint with `metal-serve convert`, which "
                         "keeps it (mlx-lm's conversions drop it)")
    if num_layers > 1 or any(name.endswith(".scales") for name in weights):
        raise ValueError(f"--speculative-config: {path}'s MTP head has {num_layers} layers"
                         f"{' and is quantized' if num_layers == 1 else ''}; metal-serve runs "
                         "one float MTP layer (`metal-serve convert` keeps it float)")
    if any(".experts.gate_up_proj" in name for name in weights):
        raise ValueError(f"--speculative-config: {path}'s MTP head has fused experts; convert "
                         "the checkpoint with `metal-serve convert` first")
    if cfg.moe is not None:
        weights = stack_per_expert(weights, cfg.moe.num_experts)
    head = head_class(cfg, moe=any(".mlp.switch_mlp." in name for name in weights))
    if hasattr(head, "sanitize"):  # e.g. DeepSeek's rope rows, reordered as the model's
        weights = head.sanitize(weights)
    head.load_weights([(name, tensor.astype(dtype)) for name, tensor in weights.items()],
                      strict=True)
    head.eval()
    mx.eval(head.parameters())
    return head
