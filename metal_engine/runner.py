"""The model runner: the only place tensors live. Launches one packed step at a time."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from metal_engine.block_tables import BlockTables
from metal_engine.cache.kv_cache import KVCache
from metal_engine.drafting.draft_model import DraftModel
from metal_engine.drafting.mtp import MtpDrafter
from metal_engine.input_batch import StepInputs, build_step_inputs
from metal_engine.lora.slots import AdapterSlots
from metal_engine.models.decoder import CausalLM
from metal_engine.outputs import TokenLogprobs
from metal_engine.pooling import Pooler
from metal_engine.sampling.logprobs import LogprobArrays, compute_logprobs
from metal_engine.sampling.rejection_sampler import (
    AcceptedTokens,
    DraftBatch,
    VerifiedTokens,
    rejection_sample,
)
from metal_engine.sampling.sampler import SamplingBatch, sample
from metal_engine.sampling.sampling_row import SamplingRow
from metal_engine.vision.encoder_cache import EncoderCache
from metal_engine.vision.image_model import ImageModel
from metal_engine.vision.step_media import image_last_keys, step_images, step_positions
from scheduler.output import PromptMedia, ScheduledRequest, SchedulerOutput, TokenHistory

if TYPE_CHECKING:
    from metal_engine.parallel.peers import Peers
    from metal_engine.parallel.pipeline import PipelineStage


@dataclass(frozen=True)
class SamplingContext:
    """The grammars' part of a step's sampling, from the engine: `allowed_tokens` holds the
    bitmask of each structured request that samples this step, and `draft_allowed_tokens`
    those of one that verifies drafts: a bitmask per verified row."""

    allowed_tokens: Mapping[str, np.ndarray] = field(default_factory=dict)
    draft_allowed_tokens: Mapping[str, list[np.ndarray]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; `sampled()` waits for its tokens.

    `token_ids` holds each sampling request's last token: the one it sampled or, where it
    verified drafts, the one it samples after all of them (what the next step feeds if they
    are all accepted). `verified` holds the whole verification, when the step had drafts.
    `pooled` holds the vector of each request that pooled in the step.
    """

    out: SchedulerOutput
    sample_request_ids: list[str]
    token_ids: mx.array | None  # [len(sample_request_ids)], being computed
    logprobs: LogprobArrays | None = None
    verified: VerifiedTokens | None = None
    pooled: dict[str, mx.array] = field(default_factory=dict)
    _accepted_on_host: list[AcceptedTokens] | None = field(default=None, init=False, repr=False)

    def arrays(self) -> list[mx.array]:
        """What the step computes for the host (the K/V writes aside)."""
        pooled = list(self.pooled.values())
        if self.token_ids is None:
            return pooled
        if self.verified is not None:
            return [self.token_ids, *self.verified.arrays(), *pooled]
        return [self.token_ids, *(self.logprobs.arrays() if self.logprobs else ()), *pooled]

    def pooled_vectors(self) -> dict[str, list[float]]:
        """The vector of each request that pooled (blocks until the device has them)."""
        return {request_id: vector.tolist() for request_id, vector in self.pooled.items()}

    def sampled(self) -> dict[str, list[int]]:
        """The new tokens per sampling request (blocks until the device has them): its
        sampled one, or its accepted drafts and the one sampled after them."""
        if self.token_ids is None:
            return {}
        if self.verified is not None:
            return {r: accepted.token_ids for r, accepted in
                    zip(self.sample_request_ids, self._accepted(), strict=True)}
        return {r: [t] for r, t in zip(self.sample_request_ids, self.token_ids.tolist(),
                                       strict=True)}

    def sampled_logprobs(self) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of each new token per sampling request that asked for them (blocks like
        `sampled()`)."""
        if self.verified is not None:
            return {r: accepted.logprobs for r, accepted in
                    zip(self.sample_request_ids, self._accepted(), strict=True)
                    if accepted.logprobs is not None}
        if self.logprobs is None:
            return {}
        by_row = self.logprobs.to_host(self.token_ids.tolist())
        return {self.sample_request_ids[row]: [lp] for row, lp in by_row.items()}

    def _accepted(self) -> list[AcceptedTokens]:
        if self._accepted_on_host is None:
            self._accepted_on_host = self.verified.to_host()
        return self._accepted_on_host


class ModelRunner:
    """Builds and queues steps; a step is evaluated only once the device is done with the last.

    MLX scatters into a pool in place only when nothing else holds the pool's buffer, and
    queued work holds its inputs' buffers until it has run: evaluated behind a step still in
    flight, each layer's K/V write would copy its pool (kernels_metal/README.md, KV writes).
    No ordering of scatters avoids that by construction (the README's "Why no scatter can
    be queued behind a step"); what the wait costs is one layer's encoding per step, since
    MLX hands the GPU each command buffer as it fills.
    """

    def __init__(self, model: CausalLM, cache: KVCache,
                 draft: DraftModel | MtpDrafter | None = None,
                 peers: Peers | None = None, stage: PipelineStage | None = None,
                 image_model: ImageModel | None = None,
                 adapters: AdapterSlots | None = None) -> None:
        """`draft`: speculative decoding's drafter on the device (a draft model or the
        model's MTP head), which runs in every step. `peers`: the other ranks of an engine
        over several (this runner is rank 0's), sent each step before it runs. `stage`: this
        rank's layers, with pipeline parallelism. `image_model`: the model's vision side,
        for a model that reads images. `adapters`: the LoRA adapters loaded over the model,
        which a request names (ScheduledRequest.lora_name)."""
        self.model = model
        self.cache = cache
        self.draft = draft
        self.peers = peers
        self.stage = stage
        self.image_model = image_model
        self.adapters = adapters
        self.encoder = EncoderCache(image_model.encode) if image_model is not None else None
        self.block_tables = BlockTables()
        self.pooler = Pooler()
        self.window_tables = BlockTables(kind="window")
        self._queued = False  # work queued on the device and not waited for since
        self._released: list[str] = []  # for the peers, with the next step
        # Token histories of the requests whose sampling reads them, from their admission
        # (ScheduledRequest.history) on, with what this runner sampled for them since.
        self._histories: dict[str, TokenHistory] = {}
        # The images of the requests whose prompts have them, from their admission on.
        self._media: dict[str, PromptMedia] = {}

    def release(self, request_ids: list[str]) -> None:
        """Drop state kept for requests that finished (call with every step's finished ids)."""
        if self.peers is not None:
            self._released += request_ids
        self.block_tables.release(request_ids)
        self.window_tables.release(request_ids)
        self.pooler.release(request_ids)
        for request_id in request_ids:
            self._histories.pop(request_id, None)
            self._media.pop(request_id, None)
        if self.draft is not None:
            self.draft.release(request_ids)

    def _forward(self, out: SchedulerOutput, input_ids: mx.array,
                 step: StepInputs) -> mx.array | None:
        """The model over the step's rows; for a hybrid model, its state slots restored from
        checkpoints before and saved to checkpoints after, as the scheduler planned. With a
        pipeline stage: on rank 0 the final hidden states of the sampling rows only (None
        where it has none to give)."""
        if self.peers is not None:  # first: they run the step with this rank
            self.peers.send_step(self._released, out)
            self._released = []
        if self.stage is not None:
            return self.stage.run(out, step, self.block_tables, self.window_tables)
        states = self.cache.states
        if states is not None:
            states.copy(out.state_plan.restores)
            states.bind(out.scheduled)
        for s in out.scheduled:
            if s.media is not None:
                self._media[s.request_id] = s.media
        if self.encoder is not None:  # the tower, for the chunks that first reach an image
            self.encoder.apply(out.encoder_plan)
        positions, images, meta = step.positions, None, step.attention
        if self._media:
            positions = step_positions(out.scheduled, self._media, positions)
            images = step_images(out.scheduled, self._media, meta.cu_seqlens_q, self.encoder)
            if images is not None and self.image_model.whole_images:
                meta = meta.with_last_keys(image_last_keys(out.scheduled, self._media,
                                                           meta.cu_seqlens_q, meta.positions))
        with self._adapter_rows(out, step):
            hidden = self.model(input_ids, mx.array(positions), meta, self.cache, images)
        if states is not None:
            states.copy(out.state_plan.saves)
        return hidden

    def _adapter_rows(self, out: SchedulerOutput, step: StepInputs):
        """A scope in which the model's linears add the step's adapter rows' deltas."""
        if self.adapters is None:  # the engine refused any request naming one
            return nullcontext()
        names = [s.lora_name for s in out.scheduled]
        return self.adapters.serving(self.adapters.step_rows(names,
                                                             step.attention.cu_seqlens_q))

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None,
               context: SamplingContext | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling on the device and return without waiting.

        Tokens the scheduler fed before knowing them (sampled by `previous`, still in flight)
        are taken from `previous`'s device array, so the step's graph is built while
        `previous` runs; it is queued once the device has finished `previous`.
        Penalties and grammars need `context`; a request missing from it samples from its
        params alone (it finished since it was scheduled: its token is dropped).
        """
        step = build_step_inputs(out, self.cache.block_size, self.block_tables,
                                 self.window_tables)
        if self.model.ops.evaluates_while_building:  # read per step: `use_ops` may swap it
            self._wait_for_device()
        by_id = {s.request_id: s for s in out.scheduled}
        for s in out.scheduled:
            if s.history is not None:
                self._histories[s.request_id] = _own_copy(s.history)
        rows = [self._sampling_row(by_id[r], context) for r in step.sample_request_ids]
        batch = _draft_batch(step, by_id, rows, context) if step.has_drafts else None
        input_ids = _with_pending_tokens(step, previous)
        drafted = None
        if self.draft is not None:  # it runs every step: its K/V must cover every position
            drafted = self.draft.draft(out, input_ids, step.draft_rows, batch,
                                       self.block_tables, self.window_tables, self._media)
            if drafted is not None:
                input_ids[mx.array(step.draft_rows)] = drafted.token_ids.astype(input_ids.dtype)
        hidden = self._forward(out, input_ids, step)
        if self.draft is not None:
            self.draft.follow(out, input_ids, hidden, self.block_tables, self.window_tables,
                              self._media)
        pooled = self._pool(out, step, hidden)
        if not step.sample_request_ids:  # prefill chunks only: just write their K/V
            # ...and, with peers, end in the last layer's sums, which theirs pair with.
            more = [hidden] if self.peers is not None and self.stage is None else []
            return self._queue(LaunchedStep(out, [], None, pooled=pooled), *more)
        sampled = hidden if self.stage is not None else _sampling_rows(hidden, step)
        logits = self.model.logits(sampled)
        if batch is not None:
            verified = (rejection_sample(logits, batch) if drafted is None else
                        rejection_sample(logits, batch, drafted.probs, drafted.token_ids))
            last = verified.row_token_ids[mx.array(batch.row_starts + batch.num_draft_tokens)]
            return self._queue(LaunchedStep(out, step.sample_request_ids, last,
                                            verified=verified, pooled=pooled))
        token_ids = sample(logits, SamplingBatch.build(rows))
        logprobs = compute_logprobs(logits, token_ids, [r.params.logprobs for r in rows])
        return self._queue(LaunchedStep(out, step.sample_request_ids, token_ids, logprobs,
                                        pooled=pooled))

    def _pool(self, out: SchedulerOutput, step: StepInputs,
              hidden: mx.array) -> dict[str, mx.array]:
        """The vectors of the requests that pool in this step (metal_engine.pooling)."""
        if not any(s.pooling is not None for s in out.scheduled):
            return {}
        if self.stage is not None:
            raise ValueError("pooling requests need every row's hidden state, which a "
                             "pipeline stage does not give: serve the model on one rank")
        return self.pooler.pool(out.scheduled, step.attention.cu_seqlens_q, hidden,
                                self.model.logits)

    def _queue(self, launched: LaunchedStep, *more: mx.array) -> LaunchedStep:
        """Evaluate the step's graph asynchronously, behind nothing that reads a pool."""
        self._wait_for_device()
        draft_pools = self.draft.cache.arrays() if self.draft is not None else []
        mx.async_eval(*launched.arrays(), *more, self.cache.arrays(), draft_pools,
                      self.pooler.arrays())
        self._queued = True
        return launched

    def _wait_for_device(self) -> None:
        """Return once the device has run (and let go of) everything queued before."""
        if self._queued:
            mx.synchronize()
            self._queued = False

    def sampled(self, launched: LaunchedStep) -> dict[str, list[int]]:
        """`launched.sampled()`, kept in the histories of the requests that sample from them."""
        sampled = launched.sampled()
        for request_id, token_ids in sampled.items():
            history = self._histories.get(request_id)
            if history is not None:
                history.output_token_ids.extend(token_ids)
        return sampled

    def _sampling_row(self, item: ScheduledRequest,
                      context: SamplingContext | None) -> SamplingRow:
        params = item.params
        if params.is_basic:
            return SamplingRow(params, item.num_output_tokens)
        if params.structured is not None and context is None:
            raise ValueError(f"request {item.request_id!r} has a grammar: launch its step with "
                             "a SamplingContext")
        allowed = context.allowed_tokens.get(item.request_id) if context is not None else None
        history = self._histories.get(item.request_id)
        if history is None:
            if params.needs_token_history:
                raise ValueError(f"request {item.request_id!r} samples from its history, which "
                                 "no step gave this runner (ScheduledRequest.history)")
            return SamplingRow(params, item.num_output_tokens, allowed_tokens=allowed)
        outputs = history.output_token_ids
        if params.needs_token_history:
            if len(outputs) < item.num_output_tokens:
                raise RuntimeError(
                    f"request {item.request_id!r} reads its earlier tokens to sample but the "
                    "last one is still being sampled: resolve the step in flight before "
                    "launching")
            del outputs[item.num_output_tokens:]  # what its request dropped (stops, rejections)
        return SamplingRow(params, item.num_output_tokens, history.prompt_token_ids, outputs,
                           history.eos_token_ids, allowed)

    def forward_step(self, out: SchedulerOutput) -> None:
        """Run a step's forward and K/V writes only: a rank other than 0 (which samples)."""
        step = build_step_inputs(out, self.cache.block_size, self.block_tables,
                                 self.window_tables)
        hidden = self._forward(out, _with_pending_tokens(step, None), step)
        mx.eval(*([] if hidden is None else [hidden]), self.cache.arrays())

    def forward_logits(self, out: SchedulerOutput) -> mx.array:
        """Logits of every packed row (for tests and diagnostics, not the serving path)."""
        step = build_step_inputs(out, self.cache.block_size)
        self._wait_for_device()
        hidden = self._forward(out, _with_pending_tokens(step, None), step)
        logits = self.model.logits(hidden)
        mx.eval(logits, self.cache.arrays())
        return logits


def _own_copy(history: TokenHistory) -> TokenHistory:
    """The runner's copy, whose outputs it extends."""
    return TokenHistory(history.prompt_token_ids, list(history.output_token_ids),
                        history.eos_token_ids)


def _draft_batch(step: StepInputs, by_id: Mapping[str, ScheduledRequest],
                 rows: list[SamplingRow], context: SamplingContext | None) -> DraftBatch:
    """The verification rows of a step with drafts, each with its grammar's bitmask."""
    drafts = [by_id[r].draft_token_ids for r in step.sample_request_ids]
    masks = [_row_masks(row, r, len(d), context)
             for row, r, d in zip(rows, step.sample_request_ids, drafts, strict=True)]
    return DraftBatch.build(rows, drafts, masks)


def _row_masks(row: SamplingRow, request_id: str, num_drafts: int,
               context: SamplingContext | None) -> list[np.ndarray] | None:
    """The grammar bitmask of each row verifying a request's drafts (None: no grammar)."""
    if context is not None and request_id in context.draft_allowed_tokens:
        return context.draft_allowed_tokens[request_id]
    return None if row.allowed_tokens is None else [row.allowed_tokens] * (num_drafts + 1)


def _sampling_rows(hidden: mx.array, step: StepInputs) -> mx.array:
    """The hidden states of the rows the step samples from (ascending rows: as many as the
    step has means every one, as they are, with no gather)."""
    if len(step.sample_rows) == hidden.shape[0]:
        return hidden
    return hidden[mx.array(step.sample_rows)]


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
