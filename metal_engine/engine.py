"""The engine loop: schedule, run, update — plus detokenization of what came out."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from kernels_metal.backends import device_ops_name
from kernels_metal.kv_quant import KVQuant, kv_quant_of
from metal_engine.cache_plan import CachePlan, plan_cache
from metal_engine.config import (
    EngineConfig,
    check_kv_cache_blocks,
    default_token_budget,
    resolve_max_model_len,
)
from metal_engine.detokenizer import IncrementalDetokenizer
from metal_engine.draft_model import DraftModel, load_draft_model
from metal_engine.kv_cache import KVCache, PoolShape
from metal_engine.kv_disk_connector import KVDiskConnector, TierStore
from metal_engine.kv_disk_dir import KVDiskDir
from metal_engine.kv_disk_store import BlockLayout, KVDiskStore, Layout, model_identity
from metal_engine.memory_plan import device_memory, plan_for
from metal_engine.model_config import ModelConfig
from metal_engine.model_dtype import resolve_dtype
from metal_engine.models.decoder import CausalLM
from metal_engine.mtp import MtpDrafter, load_mtp_head, with_draft_length
from metal_engine.outputs import RequestOutput, TokenLogprobs
from metal_engine.parallel.group import RankLost
from metal_engine.pool_bytes import bytes_per_block
from metal_engine.runner import LaunchedStep, ModelRunner, SamplingContext
from metal_engine.structured import StructuredOutputs
from metal_engine.tokenizer_loading import load_tokenizer
from metal_engine.weights import load_model, parameter_bytes
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.output import RequestUpdate, SchedulerOutput

if TYPE_CHECKING:
    from metal_engine.parallel.peers import Peers

log = logging.getLogger(__name__)


def _kv_disk_connector(config: EngineConfig, cache: KVCache) -> KVDiskConnector | None:
    """The disk tier of the prefix cache, if `--kv-cache-dir` asks for one: a store per cache
    kind (blocks, a sliding-window group's blocks, a hybrid model's state checkpoints), all
    under the directory's one size bound."""
    if config.kv_cache_dir is None:
        return None
    disk = KVDiskDir(config.kv_cache_dir, config.kv_cache_dir_size)
    stores = {}
    if cache.states is not None:
        stores["states"] = TierStore(_disk_store(config, disk, "states", cache.states.layout()),
                                     cache.states.read_slots, cache.states.write_slots)
    for kind, windowed in (("blocks", False), ("window", True)):
        shapes = cache.group_shapes(windowed)
        if not shapes:
            continue
        layout = BlockLayout(tuple(shapes), cache.block_size, cache.storage)
        stores[kind] = TierStore(_disk_store(config, disk, kind, layout),
                                 partial(cache.read_blocks, windowed=windowed),
                                 partial(cache.write_blocks, windowed=windowed))
    for kind, parts in stores.items():
        log.info("KV disk cache: %d %s (%.1f MiB) in %s", parts.store.num_blocks, kind,
                 parts.store.used_bytes / 2**20, parts.store.root)
    log.info("KV disk cache: %.1f of %.1f MiB used in %s (every model's files)",
             disk.used_bytes / 2**20, disk.max_bytes / 2**20, disk.root)
    return KVDiskConnector(stores, write_through=config.kv_write_through)


def _load_drafter(config: EngineConfig, model: CausalLM, tokenizer,
                  dtype: mx.Dtype) -> CausalLM | nn.Module | None:
    """The weights speculative decoding drafts with on the device: a draft model, or the
    model's MTP head; None for the host's methods (or none)."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("draft_model", "mtp"):
        return None
    if spec.method == "draft_model":
        return load_draft_model(Path(spec.model), dtype, model, tokenizer)
    return load_mtp_head(Path(spec.model or config.model_dir), model, dtype)


def _drafter_pool_shapes(drafter: CausalLM | nn.Module) -> list[PoolShape]:
    if isinstance(drafter, CausalLM):
        return drafter.config.kv_pool_shapes()
    return [drafter.pool_shape()]


def _device_drafter(model: CausalLM, drafter: CausalLM | nn.Module, plan: CachePlan,
                    config: EngineConfig, dtype: mx.Dtype) -> DraftModel | MtpDrafter:
    """The drafter with its K/V pools, one block per block of the model's pool."""
    shapes = _drafter_pool_shapes(drafter)
    cache = KVCache(shapes, plan.num_blocks, config.block_size, dtype)
    size = plan.num_blocks * bytes_per_block(shapes, config.block_size, dtype) / 2**20
    if isinstance(drafter, CausalLM):
        log.info("draft model %s: %d layers, its K/V in %.1f MiB beside the pool's",
                 config.speculative_config.model, drafter.config.num_hidden_layers, size)
        return DraftModel(drafter, cache)
    log.info("MTP head: its K/V in %.1f MiB beside the pool's", size)
    return MtpDrafter(model, drafter, cache)


def _disk_store(config: EngineConfig, disk: KVDiskDir, kind: str, layout: Layout) -> KVDiskStore:
    return KVDiskStore(disk, model_identity(config.model_dir, layout, kind), layout)


def _plan_pool(config: EngineConfig, cfg: ModelConfig, budget: int, dtype: mx.Dtype,
               token_budget: int, quant: KVQuant | None,
               drafter: CausalLM | nn.Module | None) -> CachePlan:
    """The cache plan for `budget` bytes. A drafter on the device keeps its K/V (unquantized)
    beside each block: the budget then splits between the two by bytes per block."""
    def plan(size: int) -> CachePlan:
        return plan_cache(cfg, size, dtype, config.block_size, config.max_num_seqs,
                          token_budget, config.enable_prefix_caching, quant)

    if drafter is None:
        return plan(budget)
    block = plan(budget).bytes_per_block
    drafter_bytes = bytes_per_block(_drafter_pool_shapes(drafter), config.block_size, dtype)
    return plan(int(budget * block / (block + drafter_bytes)))


def _log_plan(plan: CachePlan, storage: str, config: EngineConfig, max_model_len: int,
              trained: int) -> None:
    tokens = plan.num_blocks * config.block_size
    log.info("KV cache (%s): %d tokens (%d blocks of %d, %.1f MiB), %d concurrent requests at "
             "the context length %d tokens (trained: %d)", storage, tokens, plan.num_blocks,
             config.block_size, plan.num_blocks * plan.bytes_per_block / 2**20,
             min(config.max_num_seqs, tokens // max_model_len), max_model_len, trained)
    if plan.num_window_blocks:
        log.info("sliding-window layers (window %d): %d blocks of their own (%.1f MiB)",
                 plan.window, plan.num_window_blocks,
                 plan.num_window_blocks * plan.bytes_per_window_block / 2**20)
    if plan.num_state_slots:
        log.info("recurrent state: %d slots of %.1f MiB", plan.num_state_slots,
                 plan.bytes_per_state_slot / 2**20)


class LLMEngine:
    """Single-threaded: one thread adds, aborts and steps.

    `step()` runs one packed forward over every scheduled request and returns a RequestOutput
    for each request that produced text or finished.

    With `async_scheduling`, a step schedules step N+1 and builds its graph before it waits
    for step N's tokens, and detokenizes step N while step N+1 runs, so the host work overlaps
    the device's work; outputs then arrive one step later. Step N+1 is queued only once the
    device has finished step N, so its K/V writes are in place (kernels_metal/README.md).
    That pays off where the forward runs asynchronously (Metal); the CPU backend's numpy fast
    paths evaluate the forward as it is built, so there it is off by default. A request that
    reads its earlier tokens on the host to sample (penalties, a grammar) cannot sample behind
    its own pending token: before such a step the engine waits for the step in flight.
    """

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer, model_name: str,
                 async_scheduling: bool = False, kv_connector: KVDiskConnector | None = None):
        """`kv_connector` must be the connector the scheduler was given."""
        self.runner = runner
        self.kv_connector = kv_connector
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.eos_token_ids = tuple(runner.model.config.eos_token_ids) or (
            (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        )
        self.async_scheduling = async_scheduling
        self.structured = StructuredOutputs(tokenizer, self.eos_token_ids)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []
        self._in_flight: LaunchedStep | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        if config.parallel_size == 1:
            return cls._build(config, None)
        from metal_engine.parallel.peers import Peers

        peers = Peers.start(config)
        try:
            return cls._build(config, peers)
        except BaseException:
            peers.abandon()
            raise

    @classmethod
    def _build(cls, config: EngineConfig, peers: Peers | None) -> LLMEngine:
        """`peers`: the other ranks, with a share of the model each (this process is rank 0)."""
        metal = device_ops_name() == "metal"  # the one backend decision: the rest follows it
        device = device_memory(metal)  # before loading: off a Mac, the weights take what is free
        dtype = resolve_dtype(config.dtype, config.model_dir, metal=metal)
        split = peers.split if peers is not None else None
        model = load_model(config.model_dir, dtype, shard=split.cut if split else None)
        tokenizer = load_tokenizer(config.model_dir)
        drafter = _load_drafter(config, model, tokenizer, dtype)
        spec = config.speculative_config
        if spec is not None and spec.method == "mtp":
            spec = with_draft_length(spec)
        mc = model.config
        held = mc if split is None else split.cache_config(mc)  # what this rank's cache holds
        weights = parameter_bytes(model) + (parameter_bytes(drafter) if drafter else 0)
        planned = held if split is None or not split.by_layers else mc
        if peers is not None and peers.one_host:  # every rank's share and pool on this machine
            weights, planned = weights * peers.size, mc
        memory = plan_for(config, mc, weights, device)
        for line in memory.describe():
            log.info("memory plan: %s", line)
        budget = memory.budget
        token_budget = config.max_num_batched_tokens or default_token_budget(metal)
        quant = kv_quant_of(config.kv_cache_dtype)
        plan = _plan_pool(config, planned, budget, dtype, token_budget, quant, drafter)
        kv_tokens = plan.num_blocks * config.block_size
        check_kv_cache_blocks(plan.num_blocks, budget)
        max_model_len = resolve_max_model_len(config, mc.trained_context_len, kv_tokens)
        if peers is not None:
            peers.send((plan, quant))
        cache = KVCache.for_model(held, plan, config.block_size, dtype, quant,
                                  split.held_pools(model) if split else None)
        _log_plan(plan, cache.storage, config, max_model_len, mc.trained_context_len)
        connector = _kv_disk_connector(config, cache)
        scheduler = Scheduler(SchedulerConfig(
            num_blocks=plan.num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=token_budget,
            max_model_len=max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            scheduling_policy=config.scheduling_policy,
            window=plan.window,
            num_window_blocks=plan.num_window_blocks,
            num_state_slots=plan.num_state_slots,
            speculative=spec,
        ), connector)
        device_drafter = (_device_drafter(model, drafter, plan, config, dtype)
                          if drafter is not None else None)
        async_scheduling = (  # several ranks: each step's plan carries its tokens, so it waits
            metal and peers is None
            if config.async_scheduling is None else config.async_scheduling
        )
        name = config.model_name or config.model_dir.name
        stage = split.stage(model, cache, dtype) if split else None
        runner = ModelRunner(model, cache, device_drafter, peers, stage)
        return cls(runner, scheduler, tokenizer, name, async_scheduling, connector)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Queue a request; ValueError (with the limits) if it can never be served, or naming
        the schema feature if its structured output cannot be enforced.

        `priority` orders admission under the priority policy: lower values go first.
        Requests share prefix-cache blocks only when their `cache_salt` is equal.
        """
        grammar = self.structured.compile(params.structured) if params.structured else None
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids,
                          priority=priority, cache_salt=cache_salt)
        self.scheduler.add_request(request)
        if grammar is not None:
            self.structured.add(request_id, grammar)
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.stop
        )

    def abort_request(self, request_id: str) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return
        self.scheduler.finish_request(request_id, "abort")
        self._forget(request_id)
        self._pending.append(self._output(request, [], "", "abort"))

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._pending)
            or self._in_flight is not None
        )

    @property
    def peers(self) -> Peers | None:
        """The other ranks, when this engine is rank 0 of several."""
        return self.runner.peers

    def step(self) -> list[RequestOutput]:
        """Run one step. With several ranks a failed step is `RankLost`: the ranks may be
        out of step, so the engine cannot go on."""
        if self.runner.peers is None:
            return self._step()
        try:
            return self._step()
        except RankLost:
            raise
        except Exception as exc:
            raise RankLost(f"a step over several ranks failed: {exc}") from exc

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        self.runner.release(scheduled.finished_ids)
        if self.kv_connector is not None:
            self.kv_connector.before_step(scheduled.kv_plan)
        previous, launched = self._in_flight, None
        if previous is not None and self._samples_behind_pending_history(scheduled):
            outputs += self._resolve(previous)  # `previous` still supplies the pending inputs
            self._in_flight = None
        if not scheduled.is_empty:
            launched = self.runner.launch(scheduled, previous, self._sampling_context(scheduled))
            self.scheduler.advance(scheduled)
        if self.kv_connector is not None:  # reads overlap the step just launched
            self.kv_connector.after_launch(scheduled.kv_plan)
        finished, self._in_flight = self._in_flight, launched
        if not self.async_scheduling:
            finished, self._in_flight = launched, None
        if finished is not None:
            outputs += self._resolve(finished)
        return outputs

    def close(self) -> None:
        """Save every cached block in the pool to the disk tier (if any), for the next start;
        stop the other ranks (if any)."""
        if self.runner.peers is not None:
            self.runner.peers.stop()
        if self.kv_connector is None:
            return
        if self._in_flight is not None:
            self._in_flight.sampled()  # its K/V writes must land first
        states = self.scheduler.states
        window = self.scheduler.window
        self.kv_connector.close({
            "blocks": self.scheduler.pool.cached_blocks(),
            "states": states.checkpoints() if states is not None else [],
            "window": window.pool.cached_blocks() if window is not None else [],
        })

    def _samples_behind_pending_history(self, scheduled: SchedulerOutput) -> bool:
        """Whether a request that reads its earlier tokens on the host to sample (penalties, a
        grammar) samples in this step while its last token is still in flight."""
        requests = self.scheduler.requests
        return any(
            s.samples and s.params.needs_token_history
            and (request := requests.get(s.request_id)) is not None
            and request.has_pending_output
            for s in scheduled.scheduled
        )

    def _sampling_context(self, scheduled: SchedulerOutput) -> SamplingContext:
        sampling = [s for s in scheduled.scheduled if s.samples]
        drafted = {s.request_id: self.structured.draft_bitmasks(s.request_id, s.draft_token_ids)
                   for s in sampling if s.draft_token_ids and s.request_id in self.structured}
        plain = [s.request_id for s in sampling if s.request_id not in drafted]
        return SamplingContext(self.scheduler.requests, self.structured.bitmasks(plain), drafted)

    def _resolve(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs."""
        sampled, logprobs = launched.sampled(), launched.sampled_logprobs()
        updates = self.scheduler.resolve(launched.out, sampled)
        if self.kv_connector is not None:  # before the outputs go out (write-through)
            self.kv_connector.save_computed()
        return [self._process(u, logprobs.get(u.request.request_id)) for u in updates]

    def _process(self, update: RequestUpdate,
                 logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """Detokenize a request's new tokens and check its stop strings and grammar after
        each; the first that ends it drops the tokens after it (accepted drafts)."""
        request, reason = update.request, update.finish_reason
        request_id, tokens = request.request_id, update.new_token_ids
        detok = self._detokenizers[request_id]
        grammar_complete, error, stop_string, count = False, None, None, 0
        for token_id in tokens:
            count += 1
            grammar_complete = (
                request_id in self.structured and self.structured.accept(request_id, token_id)
            )
            error = self.structured.failure(request_id)
            stop_string = detok.add_token(token_id)
            if error is not None or stop_string or grammar_complete:
                break
        ended_early = count < len(tokens)  # before a token that the scheduler judged
        if ended_early:  # the accepted tokens after the end are not the request's
            request.truncate_outputs(update.num_output_tokens - (len(tokens) - count))
        if error is not None:  # the output left its grammar: it fails, whatever else ended it
            log.warning("request %s: its grammar failed while generating; ending it", request_id)
            if reason is None or ended_early:
                self.scheduler.finish_request(request_id, "error")
            reason, stop_string = "error", None
        elif (stop_string or grammar_complete) and (reason is None or ended_early):
            reason = "stop"
            self.scheduler.finish_request(request_id, reason)
        else:
            stop_string = None  # the scheduler had ended it first (length, a stop token)
        text = detok.take_delta(final=reason is not None)
        if reason is not None:
            self._forget(request_id)
        return self._output(request, tokens[:count], text, reason,
                            update.num_output_tokens - (len(tokens) - count),
                            logprobs[:count] if logprobs is not None else [],
                            stop_string, error)

    def _forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self.structured.remove(request_id)

    @staticmethod
    def _output(request: Request, token_ids: list[int], text: str, reason,
                num_output_tokens: int | None = None,
                logprobs: list[TokenLogprobs] | None = None,
                stop_string: str | None = None, error: str | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=(
                request.num_output_tokens if num_output_tokens is None else num_output_tokens
            ),
            num_cached_tokens=request.num_cached_tokens,
            logprobs=(logprobs or []) if request.params.logprobs is not None else None,
            stop_string=stop_string,
            error=error,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )
