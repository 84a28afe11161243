"""The engine loop: schedule, run, update — plus detokenization of what came out."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from metal_engine.detokenizer import IncrementalDetokenizer
from metal_engine.kv_disk.connector import KVDiskConnector
from metal_engine.lora.adapter_files import LoraAdapter, load_adapter
from metal_engine.output_check import RequestOutputCheck
from metal_engine.outputs import EngineStats, RequestOutput, TokenLogprobs
from metal_engine.parallel.group import RankLost
from metal_engine.runner import LaunchedStep, ModelRunner, SamplingContext
from metal_engine.sampling.structured import StructuredOutputs
from scheduler import Request, SamplingParams, Scheduler
from scheduler.media import PromptMedia
from scheduler.output import RequestUpdate, SchedulerOutput
from scheduler.pooling_params import PoolingParams, PoolingRefused

if TYPE_CHECKING:
    from metal_engine.loading.pooling_config import PoolingConfig
    from metal_engine.parallel.peers import Peers
    from metal_engine.vision.image_model import ImageModel

log = logging.getLogger(__name__)


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
                 async_scheduling: bool = False, connector: KVDiskConnector | None = None):
        """`connector`: the disk tier's, the one the scheduler was given."""
        self.runner = runner
        self.connector = connector
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.eos_token_ids = tuple(runner.model.config.eos_token_ids) or (
            (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        )
        self.async_scheduling = async_scheduling
        self.structured = StructuredOutputs(tokenizer, self.eos_token_ids)
        self._checks: dict[str, RequestOutputCheck] = {}  # its text and grammar, by request
        self._pending: list[RequestOutput] = []
        self._in_flight: LaunchedStep | None = None
        # Set where the model serves embeddings or rerank scores (engine_build reads it).
        self.pooling: PoolingConfig | None = None

    @property
    def image_model(self) -> ImageModel | None:
        """The model's vision side (None: it reads text only)."""
        return self.runner.image_model

    def stats(self) -> EngineStats:
        """The engine's numbers now, as plain data; only the engine thread may call this."""
        encoder = self.runner.encoder
        return EngineStats(**vars(self.scheduler.stats()),
                           kv_cache_dtype=self.runner.cache.storage,
                           encoder=encoder.stats() if encoder is not None else None)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0,
                    cache_salt: str | None = None, media: PromptMedia | None = None,
                    pooling: PoolingParams | None = None,
                    lora_name: str | None = None) -> None:
        """Queue a request; ValueError (with the limits) if it can never be served, or naming
        the schema feature if its structured output cannot be enforced.

        `priority` orders admission under the priority policy: lower values go first.
        Requests share prefix-cache blocks only when their `cache_salt` is equal. `media`:
        the prompt's images (their placeholder tokens are in `prompt_token_ids`).
        `pooling`: the request pools its prompt into one vector (`RequestOutput.pooled`)
        instead of generating; `params` then counts for nothing but its checks.
        `lora_name`: the loaded LoRA adapter to serve it with (None: the base model).
        """
        if pooling is not None:
            self._check_pooling(pooling)
        elif not self.runner.model.has_head:
            raise ValueError("the model has no LM head: it serves embeddings, not generation")
        elif self.pooling is not None:
            raise ValueError(f"the model serves {self.pooling.task} requests, not generation "
                             "(a causal LM generates when started with --task generate)")
        if lora_name is not None and lora_name not in self.adapter_names():
            raise ValueError(f"no LoRA adapter named {lora_name!r} is loaded")
        grammar = self.structured.compile(params.structured) if params.structured else None
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids,
                          priority=priority, cache_salt=cache_salt, media=media,
                          pooling=pooling, lora_name=lora_name,
                          lora_key=self._lora_key(lora_name))
        self.scheduler.add_request(request)
        if grammar is not None:
            self.structured.add(request_id, grammar)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                             params.shown_special_ids)
        self._checks[request_id] = RequestOutputCheck(request_id, detokenizer, self.structured)

    def _check_pooling(self, pooling: PoolingParams) -> None:
        """ValueError naming what this engine cannot pool so."""
        hidden_size = self.runner.model.config.hidden_size
        if pooling.dimensions is not None and pooling.dimensions > hidden_size:
            raise PoolingRefused(f"dimensions is {pooling.dimensions} but the model's "
                                 f"embeddings have {hidden_size}: ask for at most {hidden_size}",
                                 param="dimensions")
        if pooling.logit_token_ids and not self.runner.model.has_head:
            raise ValueError("the model has no LM head to read token logits from")
        if self.runner.stage is not None:
            raise ValueError("pooling needs every row's hidden state, which pipeline "
                             "parallelism does not keep on rank 0: serve on one rank")

    def _lora_key(self, lora_name: str | None) -> str | None:
        """What the blocks a request computes with adapter `lora_name` are keyed by."""
        if lora_name is None:
            return None
        return f"lora:{self.runner.adapters.fingerprints[lora_name]}"

    def adapter_names(self) -> list[str]:
        """The LoRA adapters a request may name."""
        adapters = self.runner.adapters
        return [] if adapters is None else list(adapters.names)

    def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter between steps; ValueError saying why it cannot be served."""
        self.install_adapter(self.read_adapter(name, path))

    def read_adapter(self, name: str, path: str) -> LoraAdapter:
        """The adapter in dir `path`, read and checked against the base (ValueError saying
        why it cannot be served). Reads files and shapes only, no MLX call: any thread may
        run it beside the steps, so a large adapter's files stall no step."""
        if self.runner.adapters is None:
            raise ValueError("this server serves no LoRA adapters: start it with --max-loras")
        adapter = load_adapter(name, path)
        self.runner.adapters.check(adapter)
        return adapter

    def install_adapter(self, adapter: LoraAdapter) -> None:
        """Serve an adapter `read_adapter` gave, between steps (checked again: another may
        have taken its name or the last slot since)."""
        self.runner.adapters.load(adapter)

    def unload_adapter(self, name: str) -> None:
        """Unload an adapter no unfinished request uses (ValueError otherwise)."""
        if name not in self.adapter_names():
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        users = sum(r.lora_name == name for r in self.scheduler.requests.values())
        if users:
            raise ValueError(f"LoRA adapter {name!r} serves {users} unfinished requests")
        self.runner.adapters.unload(name)

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
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        self.runner.release(scheduled.finished_ids)
        if self.connector is not None:
            self.connector.before_step(scheduled.kv_plan)
        previous, launched, resolved = self._in_flight, None, []
        if previous is not None and self._samples_behind_pending_history(scheduled):
            outputs += self._resolve(previous)  # `previous` still supplies the pending inputs
            resolved.append(previous)
            self._in_flight = None
        if not scheduled.is_empty:
            launched = self.runner.launch(scheduled, previous, self._sampling_context(scheduled))
            self.scheduler.advance(scheduled)
        if self.connector is not None:  # reads overlap the step just launched
            self.connector.after_launch(scheduled.kv_plan)
        finished, self._in_flight = self._in_flight, launched
        if not self.async_scheduling:
            finished, self._in_flight = launched, None
        if finished is not None:
            if resolved:  # two resolved in one call: neither is timed
                self.scheduler.observe_step(previous.out, None)
            outputs += self._resolve(finished)
            resolved.append(finished)
        self._observe(resolved, time.perf_counter() - start if launched is not None else None)
        return outputs

    def _observe(self, resolved: list[LaunchedStep], seconds: float | None) -> None:
        """Tell the scheduler what the call's one step took: a call that launches one step
        and resolves one (the same, or the one before it under async scheduling) runs one
        step's period. Calls that resolve two, or launch none, are not timed."""
        if resolved:
            self.scheduler.observe_step(resolved[-1].out, seconds if len(resolved) == 1 else None)

    def close(self) -> None:
        """Save every cached block in the pool to the disk tier (if any), for the next start;
        stop the other ranks (if any)."""
        if self.runner.peers is not None:
            self.runner.peers.stop()
        if self.connector is None:
            return
        if self._in_flight is not None:
            self._in_flight.sampled()  # its K/V writes must land first
        self.connector.close(self.scheduler.cached())

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
        return SamplingContext(self.structured.bitmasks(plain), drafted)

    def _resolve(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs."""
        sampled, logprobs = self.runner.sampled(launched), launched.sampled_logprobs()
        pooled = launched.pooled_vectors()
        updates = self.scheduler.resolve(launched.out, sampled, self._checks)
        if self.connector is not None:  # before the outputs go out (write-through)
            self.connector.save_computed()
        return [self._process(u, logprobs.get(u.request.request_id),
                              pooled.get(u.request.request_id)) for u in updates]

    def _process(self, update: RequestUpdate, logprobs: list[TokenLogprobs] | None,
                 pooled: list[float] | None = None) -> RequestOutput:
        """A request's new tokens as text (all of it once the request has ended), or the
        vector it pooled."""
        request, reason = update.request, update.finish_reason
        if pooled is not None:
            self._forget(request.request_id)
            output = self._output(request, [], "", reason, 0)
            output.pooled = pooled
            return output
        text = self._checks[request.request_id].take_delta(final=reason is not None)
        if reason is not None:
            self._forget(request.request_id)
        tokens = update.new_token_ids
        return self._output(request, tokens, text, reason, update.num_output_tokens,
                            logprobs[: len(tokens)] if logprobs is not None else [],
                            update.stop_string, update.error)

    def _forget(self, request_id: str) -> None:
        self._checks.pop(request_id, None)
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
