"""AsyncEngine against a scripted engine: delivery, refusals, aborts, engine failures (kept to
the requests they touch), requests of several choices, draining, the queue limit and observers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from metal_engine.outputs import EngineStats, RequestOutput
from scheduler import SamplingParams
from scheduler.sampling_params import StructuredOutput
from server.async_engine import AsyncEngine, EngineError, QueueFull
from server.core import engine_choices


class GarbledOutput:
    """An output whose `finished` cannot be read."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    @property
    def finished(self) -> bool:
        raise AttributeError("garbled output")


class ScriptedEngine:
    """Emits one token ("x") per step per request; remembers every call it gets."""

    tokenizer = None
    model_name = "scripted"
    max_model_len = 64
    peers = None  # one rank

    def __init__(self) -> None:
        self.requests: dict[str, tuple[int, SamplingParams, int]] = {}  # id -> (prompt, p, done)
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_next_step = False
        self.fail_add_of: set[str] = set()  # add_request raises RuntimeError for these
        self.poison: str | None = None  # a step with this request live raises
        self.stuck: set[str] = set()  # abort_request leaves these in place
        self.garbled: str | None = None  # this request gets an output the bridge cannot read
        self.gate = threading.Event()  # step waits for it; set unless a test holds steps
        self.gate.set()
        self.threads: set[str] = set()
        self.closed_on: str | None = None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None):
        self.threads.add(threading.current_thread().name)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt too long, limit {self.max_model_len}")
        if request_id in self.fail_add_of:
            raise RuntimeError(f"cannot add {request_id}")
        self.requests[request_id] = (len(prompt_token_ids), params, 0)

    def abort_request(self, request_id: str) -> None:
        if request_id in self.stuck:
            return
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        self.closed_on = threading.current_thread().name

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        self.gate.wait()
        time.sleep(0.002)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("kernel exploded")
        if self.poison in self.requests:
            raise RuntimeError(f"{self.poison} broke the step")
        outputs = []
        for rid, (num_prompt, params, done) in list(self.requests.items()):
            if rid == self.garbled:
                outputs.append(GarbledOutput(rid))
                continue
            done += 1
            finished = done >= params.max_tokens
            self.requests[rid] = (num_prompt, params, done)
            if finished:
                del self.requests[rid]
            reason = "length" if finished else None
            outputs.append(RequestOutput(rid, [7], "x", reason, num_prompt, done))
        return outputs


@pytest.fixture
def engine():
    scripted = ScriptedEngine()
    bridge = AsyncEngine(scripted)
    yield scripted, bridge
    bridge.shutdown()


async def _collect(bridge: AsyncEngine, request_id: str, max_tokens: int, prompt_len: int = 3):
    params = SamplingParams(max_tokens=max_tokens)
    return [o async for o in bridge.generate(list(range(prompt_len)), params, request_id)]


def test_outputs_arrive_in_order_and_only_the_engine_thread_touches_the_engine(engine):
    scripted, bridge = engine

    async def main():
        return await asyncio.gather(*(_collect(bridge, f"r{i}", 2 + i) for i in range(8)))

    results = asyncio.run(main())
    for i, outputs in enumerate(results):
        assert [o.num_output_tokens for o in outputs] == list(range(1, 3 + i))
        assert outputs[-1].finish_reason == "length"
        assert not any(o.finished for o in outputs[:-1])
    assert scripted.threads == {"engine-loop"}
    assert not scripted.has_unfinished_requests()


def test_idle_engine_thread_does_not_step(engine):
    scripted, bridge = engine
    asyncio.run(_collect(bridge, "warm", 2))
    steps = scripted.steps
    time.sleep(0.2)
    assert scripted.steps == steps


def test_refused_request_raises_value_error_before_any_output(engine):
    scripted, bridge = engine
    with pytest.raises(ValueError, match="limit 64"):
        asyncio.run(_collect(bridge, "long", 4, prompt_len=100))
    assert scripted.aborted == []  # never added, so nothing to abort
    assert len(asyncio.run(_collect(bridge, "next", 3))) == 3


def test_consumer_stopping_early_aborts_the_request(engine):
    scripted, bridge = engine

    async def take_two():
        outputs = bridge.generate([1, 2], SamplingParams(max_tokens=1000), "early")
        async for output in outputs:
            if output.num_output_tokens == 2:
                break
        await outputs.aclose()

    asyncio.run(take_two())
    _wait_for(lambda: scripted.aborted == ["early"])
    assert not scripted.has_unfinished_requests()


def test_cancelled_consumer_aborts_the_request(engine):
    scripted, bridge = engine

    async def cancel_midway():
        task = asyncio.create_task(_collect(bridge, "cancelled", 100_000))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    _wait_for(lambda: scripted.aborted == ["cancelled"])


def test_step_failure_fails_live_requests_and_keeps_serving(engine):
    scripted, bridge = engine

    async def fail_then_serve():
        victims = [asyncio.create_task(_collect(bridge, f"v{i}", 1000)) for i in range(3)]
        await asyncio.sleep(0.05)
        scripted.fail_next_step = True
        results = await asyncio.gather(*victims, return_exceptions=True)
        return results, await _collect(bridge, "after", 3)

    results, after = asyncio.run(fail_then_serve())
    assert all(isinstance(r, EngineError) and "kernel exploded" in str(r) for r in results)
    assert sorted(scripted.aborted) == ["v0", "v1", "v2"]
    assert after[-1].finish_reason == "length"


def test_work_run_on_the_engine_thread_returns_or_raises_there(engine):
    scripted, bridge = engine
    assert bridge.run_on_engine_thread(lambda: threading.current_thread().name) == "engine-loop"
    with pytest.raises(ZeroDivisionError):
        bridge.run_on_engine_thread(lambda: 1 / 0)
    asyncio.run(_collect(bridge, "after", 2))  # the thread serves on
    assert scripted.threads == {"engine-loop"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_work_for_an_engine_thread_that_died_or_stopped_fails_instead_of_hanging():
    class NoStats(ScriptedEngine):
        def stats(self) -> EngineStats:
            raise RuntimeError("no stats")

    dead = AsyncEngine(NoStats())
    with pytest.raises(EngineError, match="shutting down"):
        dead.run_on_engine_thread(lambda: 1)
    dead.shutdown()  # joins the dead thread: its exception is reported within this test
    stopped = AsyncEngine(ScriptedEngine())
    stopped.shutdown()
    with pytest.raises(EngineError, match="shutting down"):
        stopped.run_on_engine_thread(lambda: 1)


def _wait_for(condition, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_shutdown_fails_live_requests_and_refuses_new_ones(engine):
    scripted, bridge = engine

    async def shut_down_midway():
        task = asyncio.create_task(_collect(bridge, "live", 100_000))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(bridge.shutdown)
        with pytest.raises(EngineError, match="shutting down"):
            await task
        with pytest.raises(EngineError, match="shut down"):
            await _collect(bridge, "late", 2)

    asyncio.run(shut_down_midway())
    assert scripted.aborted == ["live"]
    assert scripted.closed_on == "engine-loop"  # closed last, where the engine lives


async def _start_three_choices(bridge: AsyncEngine) -> engine_choices.Choices:
    params = SamplingParams(max_tokens=100_000)
    return await engine_choices.start(bridge, [1, 2, 3], params, "multi", n=3)


async def _all_three_aborted(scripted: ScriptedEngine) -> None:
    # Checked while the event loop still runs: closing the loop would cancel leftovers anyway.
    deadline = time.monotonic() + 2
    while sorted(scripted.aborted) != ["multi-0", "multi-1", "multi-2"]:
        assert time.monotonic() < deadline, f"aborted only {scripted.aborted}"
        await asyncio.sleep(0.01)


def test_closing_the_stream_of_several_choices_aborts_every_choice(engine):
    scripted, bridge = engine

    async def read_each_then_leave():
        choices = await _start_three_choices(bridge)
        seen = set()
        async for index, _ in choices:
            seen.add(index)
            if seen == {0, 1, 2}:
                break
        await choices.aclose()
        await _all_three_aborted(scripted)

    asyncio.run(read_each_then_leave())
    assert not scripted.has_unfinished_requests()


def test_cancelled_collection_of_several_choices_aborts_every_choice(engine):
    scripted, bridge = engine

    async def cancel_midway():
        task = asyncio.create_task(engine_choices.collect(await _start_three_choices(bridge), 3))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _all_three_aborted(scripted)

    asyncio.run(cancel_midway())


# ---- one request's failure stays its own ----------------------------------------------------


def _gather(bridge: AsyncEngine, max_tokens: dict[str, int]):
    async def main():
        jobs = (_collect(bridge, rid, n) for rid, n in max_tokens.items())
        return dict(zip(max_tokens, await asyncio.gather(*jobs, return_exceptions=True),
                        strict=True))

    return asyncio.run(main())


def test_failed_add_fails_only_that_request(engine):
    scripted, bridge = engine
    scripted.fail_add_of = {"bad"}
    results = _gather(bridge, {"a": 20, "bad": 20, "b": 20})
    assert isinstance(results["bad"], EngineError) and "cannot add bad" in str(results["bad"])
    assert [o.finish_reason for o in results["a"]][-1] == "length" and len(results["a"]) == 20
    assert len(results["b"]) == 20


def test_undeliverable_output_fails_only_its_request(engine):
    scripted, bridge = engine
    scripted.garbled = "garbled"
    results = _gather(bridge, {"a": 10, "garbled": 10})
    assert isinstance(results["garbled"], EngineError)
    assert len(results["a"]) == 10 and results["a"][-1].finish_reason == "length"
    assert "garbled" in scripted.aborted


def test_step_raising_for_one_request_fails_that_step_and_the_thread_serves_on(engine):
    scripted, bridge = engine
    scripted.poison = "poison"

    async def poison_midway():
        running = [asyncio.create_task(_collect(bridge, f"ok{i}", 1000)) for i in range(2)]
        await asyncio.sleep(0.05)
        poisoned = await asyncio.gather(_collect(bridge, "poison", 5), return_exceptions=True)
        ran = await asyncio.gather(*running, return_exceptions=True)
        return poisoned + ran, await _collect(bridge, "after", 3)

    failed, after = asyncio.run(poison_midway())
    assert all(isinstance(r, EngineError) and "poison broke the step" in str(r) for r in failed)
    assert sorted(scripted.aborted) == ["ok0", "ok1", "poison"]
    assert after[-1].finish_reason == "length"
    assert bridge._thread.is_alive()


def test_failed_step_with_leftovers_does_not_spin(engine):
    scripted, bridge = engine
    scripted.poison = "poison"
    scripted.stuck = {"poison"}  # the engine cannot drop it: every step would fail again
    with pytest.raises(EngineError):
        asyncio.run(_collect(bridge, "poison", 5))
    steps = scripted.steps
    time.sleep(0.2)
    assert scripted.steps == steps


# ---- drain, queue limit, observers ----------------------------------------------------------


def test_abort_all_ends_live_requests_with_finish_reason_abort(engine):
    scripted, bridge = engine

    async def abort_midway():
        tasks = [asyncio.create_task(_collect(bridge, f"r{i}", 100_000, prompt_len=5))
                 for i in range(2)]
        await asyncio.sleep(0.05)
        bridge.abort_all()
        return await asyncio.gather(*tasks)

    for outputs in asyncio.run(abort_midway()):
        last = outputs[-1]
        assert last.finish_reason == "abort" and last.new_text == ""
        assert last.num_prompt_tokens == 5
        assert last.num_output_tokens == outputs[-2].num_output_tokens > 0
    assert sorted(scripted.aborted) == ["r0", "r1"]
    assert asyncio.run(_collect(bridge, "after", 2))[-1].finish_reason == "length"


def test_requests_beyond_the_queue_limit_raise_queue_full():
    scripted = ScriptedEngine()
    bridge = AsyncEngine(scripted, max_queued_requests=2)
    scripted.gate.clear()  # no first output yet: both requests keep waiting

    async def overflow():
        waiting = [asyncio.create_task(_collect(bridge, f"w{i}", 2)) for i in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match="2 requests waiting"):
            await _collect(bridge, "third", 2)
        scripted.gate.set()
        await asyncio.gather(*waiting)
        for _ in range(2):  # refusals give their slots back too
            with pytest.raises(ValueError):
                await _collect(bridge, "too-long", 2, prompt_len=100)
        return await asyncio.gather(*(_collect(bridge, f"later{i}", 2) for i in range(2)))

    try:
        assert all(o[-1].finish_reason == "length" for o in asyncio.run(overflow()))
    finally:
        scripted.gate.set()
        bridge.shutdown()


class RecordingObserver:
    def __init__(self) -> None:
        self.seen: list[int | str] = []  # output token counts, then the outcome

    def on_output(self, output: RequestOutput) -> None:
        self.seen.append(output.num_output_tokens)

    def on_finish(self, outcome: str) -> None:
        self.seen.append(outcome)


def test_observers_see_each_output_and_how_the_request_ended(engine):
    scripted, bridge = engine
    observers: list[RecordingObserver] = []

    def observer() -> RecordingObserver:
        observers.append(RecordingObserver())
        return observers[-1]

    async def leave_after_two():
        outputs = bridge.generate([1, 2], SamplingParams(max_tokens=1000), "left")
        async for output in outputs:
            if output.num_output_tokens == 2:
                break
        await outputs.aclose()

    bridge.observe_requests(observer)
    asyncio.run(_collect(bridge, "ok", 3))
    asyncio.run(leave_after_two())
    with pytest.raises(ValueError):
        asyncio.run(_collect(bridge, "refused", 3, prompt_len=100))
    scripted.fail_next_step = True
    with pytest.raises(EngineError):
        asyncio.run(_collect(bridge, "failed", 3))
    assert [o.seen for o in observers] == [
        [1, 2, 3, "length"], [1, 2, "abort"], ["rejected"], ["error"]
    ]


class _Grammars:
    """The engine's grammar compiler: records the thread of each compile; refuses "bad"."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def compile(self, structured: StructuredOutput) -> None:
        self.threads.append(threading.current_thread().name)
        if structured.json_schema == "bad":
            raise ValueError("the schema cannot be generated")


def test_grammars_compile_on_the_grammar_worker_before_the_engine_sees_them(engine):
    scripted, bridge = engine
    scripted.structured = grammars = _Grammars()

    async def run(schema: str, request_id: str) -> list:
        params = SamplingParams(max_tokens=2, structured=StructuredOutput(json_schema=schema))
        return [o async for o in bridge.generate([1, 2], params, request_id)]

    assert len(asyncio.run(run('{"type": "object"}', "good"))) == 2
    with pytest.raises(ValueError, match="cannot be generated"):
        asyncio.run(run("bad", "bad"))
    assert all(name.startswith("grammar") for name in grammars.threads)
    assert len(grammars.threads) == 2 and "bad" not in scripted.requests
