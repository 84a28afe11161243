"""The checked dispatcher: a launch that first fails when its graph is evaluated (a Metal compile
error or thread limit surfaces inside `mx.async_eval`) falls its variant back, visibly, and no
request fails for it.

On the CPU backend the failure is real MLX evaluation: the graph holds an LU factorization of a
singular matrix, which raises only when evaluated, as a kernel that does not compile does.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import generate_greedy, make_runner_and_scheduler
from markers import requires_emulator

from kernels_metal import attention, emulator
from kernels_metal.dispatch import CheckedDispatch, Fallback
from kernels_metal.fallbacks import all_fallbacks
from kernels_metal.paged import PagedAttentionKernels

log = logging.getLogger("test_dispatch_fallback")


def fails_when_evaluated(x: mx.array) -> mx.array:
    """`x`, except that evaluating it raises."""
    poison = mx.linalg.inv(mx.zeros((2, 2)), stream=mx.cpu)[0, 0]
    return x + (0 * poison).astype(x.dtype)


def fake_metal_kernel(broken):
    """A `metal_kernel` factory whose kernels double their input; launches `broken(call)`
    picks fail when evaluated."""
    def factory(**spec):
        def launch(**call):
            y = call["inputs"][0] * 2
            return [fails_when_evaluated(y) if broken(call) else y]
        return launch
    return factory


class Doubler:
    """A kernel family of one kernel, built on a `metal_kernel` factory as the real ones are."""

    def __init__(self, metal_kernel) -> None:
        self.kernel = metal_kernel(name="double", input_names=["x"], output_names=["y"],
                                   source="y[0] = 2 * x[0];")
        self.calls = 0

    def __call__(self, x: mx.array) -> mx.array:
        self.calls += 1
        return self.kernel(inputs=[x], template=[("T", x.dtype)], grid=(x.size, 1, 1),
                           threadgroup=(32, 1, 1), output_shapes=[x.shape],
                           output_dtypes=[x.dtype])[0]


def check(kernels: Doubler, variant: str) -> str | None:
    """The first-use check: 4 elements, which MLX binds in constant space."""
    x = mx.arange(4, dtype=mx.float32)
    return None if np.array_equal(np.array(kernels(x)), np.arange(4) * 2) else "wrong result"


@pytest.fixture
def doubling():
    """A dispatcher for the family, and the kernels it is told to use (on the fake factory:
    launches of 8 or more elements, in device space, fail when evaluated)."""
    dispatch = CheckedDispatch("doubler", Doubler, check, log)
    broken = fake_metal_kernel(lambda call: call["inputs"][0].size >= 8)
    return dispatch, Doubler(dispatch.recorded(broken))


def double(dispatch: CheckedDispatch, variant: str, n: int) -> mx.array:
    x = mx.arange(n, dtype=mx.float32)
    return dispatch.call(variant, lambda kernels: kernels(x), lambda: x + x)


def test_a_launch_that_fails_when_evaluated_falls_back_and_its_call_is_served(doubling,
                                                                               caplog):
    dispatch, kernels = doubling
    with dispatch.use(kernels, first_use_check=True), caplog.at_level(logging.WARNING):
        np.testing.assert_array_equal(np.array(double(dispatch, "v1", 4)), np.arange(4) * 2)
        assert kernels.calls == 2  # the check, then the call
        wide = double(dispatch, "v1", 16)  # a new launch: evaluated inside the call
        np.testing.assert_array_equal(np.array(wide), np.arange(16) * 2)  # no error left
        assert kernels.calls == 3
        np.array(double(dispatch, "v1", 4))
        assert kernels.calls == 3  # the variant stays on the reference
        np.array(double(dispatch, "v2", 4))
        assert kernels.calls == 5  # another variant keeps the kernels: its check, its call
        fallbacks = dispatch.fallbacks()
    assert [(f.kernel, f.variant) for f in fallbacks] == [("doubler", "v1")]
    assert "LU factorization failed" in fallbacks[0].reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "doubler kernels off for v1" in warnings[0]


def test_launches_already_evaluated_are_not_evaluated_again(doubling):
    """A proven launch configuration costs no evaluation inside the call: the graph stays
    lazy for the runner to queue (the poisoned launch shows whether the call evaluated it)."""
    dispatch, _ = doubling
    poisoned_when_proven = Doubler(dispatch.recorded(
        fake_metal_kernel(lambda call: call["inputs"][0].size == 5)))
    with dispatch.use(poisoned_when_proven, first_use_check=True):
        lazy = double(dispatch, "v1", 5)  # 5 elements: a constant-space launch, as the check's
        assert not dispatch.fallbacks()
    with pytest.raises(RuntimeError, match="LU factorization"):
        mx.eval(lazy)


def test_calls_whose_launches_were_served_skip_the_route_until_it_changes(doubling,
                                                                         monkeypatch):
    """`call(..., launches=...)`: a call like one the kernels served runs on them without
    the route (a hybrid model's linear-attention layers after the first); a fallback drops
    what was served, so the variant's calls then go to the reference."""
    dispatch, kernels = doubling
    routes = []
    route = dispatch._route
    monkeypatch.setattr(dispatch, "_route", lambda *a: routes.append(a) or route(*a))

    def double_as(n: int) -> mx.array:
        x = mx.arange(n, dtype=mx.float32)
        return dispatch.call("v1", lambda kernels: kernels(x), lambda: x + x, launches=n)

    with dispatch.use(kernels, first_use_check=True):
        for _ in range(3):
            np.testing.assert_array_equal(np.array(double_as(4)), np.arange(4) * 2)
        assert len(routes) == 1 and kernels.calls == 4  # the check, then three calls
        np.array(double_as(16))  # new launches: routed, evaluated, failed, fallen back
        assert len(routes) == 2 and kernels.calls == 5
        np.testing.assert_array_equal(np.array(double_as(4)), np.arange(4) * 2)
        assert len(routes) == 3 and kernels.calls == 5  # the reference served it


def test_unchecked_kernels_let_an_evaluation_failure_through(doubling):
    dispatch, kernels = doubling
    with dispatch.use(kernels):
        wide = double(dispatch, "v1", 16)
    with pytest.raises(RuntimeError, match="LU factorization"):
        mx.eval(wide)


PREFILL = "paged_attention_prefill"


def merge_zero_fails_when_evaluated(**spec):
    """Emulated kernels whose prefill launch without decode rows (MERGE=0, which the
    first-use check's mixed step never makes) fails when evaluated."""
    kernel = emulator.metal_kernel(**spec)
    if spec["name"] != PREFILL:
        return kernel

    def launch(**call):
        outputs = kernel(**call)
        if not dict(call["template"])["MERGE"]:
            outputs = [fails_when_evaluated(out) for out in outputs]
        return outputs
    return launch


@requires_emulator
def test_serving_a_launch_that_fails_when_evaluated_fails_no_request(tiny_llama, caplog):
    _, path = tiny_llama
    rng = np.random.default_rng(3)
    prompts = {f"r{i}": [int(t) for t in rng.integers(3, 128, n)] for i, n in enumerate([5, 21])}
    expected = generate_greedy(*make_runner_and_scheduler(path), prompts, max_tokens=4)
    kernels = PagedAttentionKernels(attention._state.recorded(merge_zero_fails_when_evaluated))
    with (attention.use_kernels(kernels, first_use_check=True),
          caplog.at_level(logging.WARNING, logger="kernels_metal.attention")):
        got = generate_greedy(*make_runner_and_scheduler(path), prompts, max_tokens=4)
        fallbacks = all_fallbacks()
    assert got == expected  # the prefill-only first step went to the CPU path, and the rest
    assert fallbacks == [Fallback("attention", "float32-d16-bs16-h6kv2", fallbacks[0].reason)]
    assert "LU factorization failed" in fallbacks[0].reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "float32-d16-bs16-h6kv2" in warnings[0]


def attention_step(requests, seed: int):
    """Queries and metadata of a step over pools of 17 blocks of 16 rows: `requests` as
    (tokens cached before, rows now), each with blocks of its own."""
    rng = np.random.default_rng(seed)
    seq_lens = np.array([c + n for c, n in requests], np.int32)
    q_lens = [n for _, n in requests]
    tables = np.zeros((len(requests), 4), np.int32)
    for r in range(len(requests)):
        tables[r] = np.arange(1 + 4 * r, 5 + 4 * r)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = attention.AttentionMetadata(cu, seq_lens, tables, np.zeros(int(cu[-1]), np.int64),
                                       16)
    q = mx.array(rng.standard_normal((int(cu[-1]), 4, 16)).astype(np.float32))
    return q, meta


@requires_emulator
def test_a_kind_of_layer_keeps_its_route_across_steps_until_its_launches_change(monkeypatch):
    """A later step's layers of a kind the kernels served run on them without the route;
    a step that launches them another way (a prefill-only step: MERGE=0, which the check
    never made) is routed, its new launch evaluated in the call, and falls back."""
    state = attention._Dispatch()
    monkeypatch.setattr(attention, "_state", state)
    routes = []
    route = state._route
    monkeypatch.setattr(state, "_route", lambda *a: routes.append(a) or route(*a))
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.standard_normal((17, 16, 2, 16)).astype(np.float32)) for _ in "kv")
    kernels = PagedAttentionKernels(state.recorded(merge_zero_fails_when_evaluated))
    steps = [((20, 1), (5, 7)), ((21, 1), (12, 9)), ((40, 9),), ((22, 1), (30, 6))]
    routed = []
    with attention.use_kernels(kernels, first_use_check=True):
        for i, requests in enumerate(steps):
            q, meta = attention_step(requests, i)
            out = attention.paged_attention(q, k, v, meta, 0.25)
            expected = attention.paged_attention_reference(q, k, v, meta, 0.25)
            np.testing.assert_allclose(np.array(out), np.array(expected), atol=1e-5)
            routed.append(len(routes))
        fallbacks = all_fallbacks()
    assert routed == [1, 1, 2, 3]  # the mixed step again: no route; the others: routed
    assert [f.variant for f in fallbacks] == ["float32-d16-bs16-h4kv2"]
