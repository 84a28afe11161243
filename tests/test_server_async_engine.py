"""AsyncEngine against a scripted engine: delivery, refusals, aborts, engine failures, and
requests of several choices."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from metal_engine.outputs import RequestOutput
from scheduler import SamplingParams
from server import generation
from server.async_engine import AsyncEngine, EngineError


class ScriptedEngine:
    """Emits one token ("x") per step per request; remembers every call it gets."""

    tokenizer = None
    model_name = "scripted"
    max_model_len = 64

    def __init__(self) -> None:
        self.requests: dict[str, tuple[int, SamplingParams, int]] = {}  # id -> (prompt, p, done)
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_next_step = False
        self.threads: set[str] = set()
        self.closed_on: str | None = None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0):
        self.threads.add(threading.current_thread().name)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt too long, limit {self.max_model_len}")
        self.requests[request_id] = (len(prompt_token_ids), params, 0)

    def abort_request(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        self.closed_on = threading.current_thread().name

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        time.sleep(0.002)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("kernel exploded")
        outputs = []
        for rid, (num_prompt, params, done) in list(self.requests.items()):
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


async def _start_three_choices(bridge: AsyncEngine) -> generation.Choices:
    params = SamplingParams(max_tokens=100_000)
    return await generation.start(bridge, [1, 2, 3], params, "multi", n=3)


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
        task = asyncio.create_task(generation.collect(await _start_three_choices(bridge), 3))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _all_three_aborted(scripted)

    asyncio.run(cancel_midway())
