"""The engine loop: schedule, run, update — plus detokenization of what came out."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from metal_engine.detokenizer import IncrementalDetokenizer
from metal_engine.kv_disk_connector import KVDiskConnector
from metal_engine.outputs import EngineStats, RequestOutput, TokenLogprobs
from metal_engine.parallel.group import RankLost
from metal_engine.runner import LaunchedStep, ModelRunner, SamplingContext
from metal_engine.structured import StructuredOutputs
from scheduler import Request, SamplingParams, Scheduler
from scheduler.output import RequestUpdate, SchedulerOutput

if TYPE_CHECKING:
    from metal_engine.parallel.peers import Peers

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

    def stats(self) -> EngineStats:
        """The engine's numbers now, as plain data; only the engine thread may call this."""
        return EngineStats(**vars(self.scheduler.stats()),
                           kv_cache_dtype=self.runner.cache.storage)

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
        return SamplingContext(self.structured.bitmasks(plain), drafted)

    def _resolve(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs."""
        sampled, logprobs = self.runner.sampled(launched), launched.sampled_logprobs()
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
