"""The engine loop: schedule, run, update — plus detokenization of what came out."""

from __future__ import annotations

import logging

import mlx.core as mx
from transformers import AutoTokenizer

from metal_engine.config import EngineConfig
from metal_engine.detokenizer import IncrementalDetokenizer
from metal_engine.kv_cache import KVCache, bytes_per_block, default_kv_cache_memory
from metal_engine.outputs import RequestOutput
from metal_engine.runner import LaunchedStep, ModelRunner
from metal_engine.weights import load_model, parameter_bytes, resolve_dtype
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.scheduler import RequestUpdate

log = logging.getLogger(__name__)


class LLMEngine:
    """Single-threaded: one thread adds, aborts and steps.

    `step()` runs one packed forward over every scheduled request and returns a RequestOutput
    for each request that produced text or finished.

    With `async_scheduling`, a step schedules and queues step N+1 on the device before it
    waits for step N's tokens, so the host work (scheduling, input packing, building the
    graph, detokenizing) overlaps the device's work; outputs then arrive one step later.
    That pays off where the forward runs asynchronously (Metal); the CPU backend's numpy fast
    paths evaluate the forward as it is built, so there it is off by default.
    """

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer, model_name: str,
                 async_scheduling: bool = False):
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.eos_token_ids = tuple(runner.model.config.eos_token_ids) or (
            (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        )
        self.async_scheduling = async_scheduling
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []
        self._in_flight: LaunchedStep | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        dtype = resolve_dtype(config.dtype)
        model = load_model(config.model_dir, dtype)
        mc = model.config
        per_block = bytes_per_block(
            mc.num_hidden_layers, config.block_size, mc.num_key_value_heads, mc.head_dim, dtype
        )
        budget = config.kv_cache_memory or default_kv_cache_memory(parameter_bytes(model))
        num_blocks = budget // per_block
        max_model_len = config.max_model_len or min(
            mc.max_position_embeddings, num_blocks * config.block_size
        )
        if num_blocks * config.block_size < min(max_model_len, 2 * config.block_size):
            raise ValueError(
                f"a KV cache of {budget} bytes holds {num_blocks} blocks, too few to serve: "
                "raise --kv-cache-memory"
            )
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), max model len %d",
            num_blocks, config.block_size, num_blocks * per_block / 2**20, max_model_len,
        )
        cache = KVCache(mc.num_hidden_layers, num_blocks, config.block_size,
                        mc.num_key_value_heads, mc.head_dim, dtype)
        scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            scheduling_policy=config.scheduling_policy,
        ))
        tokenizer = AutoTokenizer.from_pretrained(str(config.model_dir))
        async_scheduling = (
            mx.metal.is_available() if config.async_scheduling is None else config.async_scheduling
        )
        return cls(ModelRunner(model, cache), scheduler, tokenizer, config.model_dir.name,
                   async_scheduling)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0) -> None:
        """Queue a request; ValueError (with the limits) if it can never be served.

        `priority` orders admission under the priority policy: lower values go first.
        """
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids,
                          priority=priority)
        self.scheduler.add_request(request)
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.stop
        )

    def abort_request(self, request_id: str) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return
        self.scheduler.finish_request(request_id, "abort")
        self._detokenizers.pop(request_id, None)
        self._pending.append(self._output(request, [], "", "abort"))

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._pending)
            or self._in_flight is not None
        )

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        launched = None
        if not scheduled.is_empty:
            launched = self.runner.launch(scheduled, previous=self._in_flight)
            self.scheduler.advance(scheduled)
        finished, self._in_flight = self._in_flight, launched
        if not self.async_scheduling:
            finished, self._in_flight = launched, None
        if finished is not None:
            outputs += self._resolve(finished)
        return outputs

    def _resolve(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs."""
        updates = self.scheduler.resolve(launched.out, launched.sampled())
        return [self._process(update) for update in updates]

    def _process(self, update: RequestUpdate) -> RequestOutput:
        request, reason = update.request, update.finish_reason
        detok = self._detokenizers[request.request_id]
        if detok.add_token(update.new_token_ids[-1]) and reason is None:
            reason = "stop"
            self.scheduler.finish_request(request.request_id, reason)
        text = detok.take_delta(final=reason is not None)
        if reason is not None:
            del self._detokenizers[request.request_id]
        return self._output(request, update.new_token_ids, text, reason, update.num_output_tokens)

    @staticmethod
    def _output(request: Request, token_ids: list[int], text: str, reason,
                num_output_tokens: int | None = None) -> RequestOutput:
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
        )
