"""LoRA adapters in the CPU backend's host forward: the compiled loop that adds a few rows'
deltas against `Ops.low_rank` (MLX's gathered products), and the compiled layer steps
(all layers in one call, or one layer in two) serving a batch that mixes adapters and the
base with the pure-MLX reference's logits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from scheduler_helpers import run_step
from test_host_forward import count_calls
from test_lora import ADAPTERS, PROMPT, family, serving  # noqa: F401 (a fixture)

from kernels_metal.cpu import host_forward
from kernels_metal.cpu import layer as cpu_layer
from kernels_metal.cpu import low_rank as cpu_low_rank
from kernels_metal.cpu import threads as cpu_threads
from kernels_metal.cpu.host_forward import HostStack
from kernels_metal.ops import ReferenceOps
from scheduler import Request, SamplingParams


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [[0, 2, 1, 2, 0, 3, 1, 3, 3], [3], [0, 0]])
def test_host_rows_deltas_equal_the_gathered_products(rows, threads, monkeypatch):
    """Rows of three adapters and the base in any order, into a view of a wider product's
    columns (as a packed q/k/v's), on one thread or shared out."""
    monkeypatch.setattr(cpu_threads, "_threads", threads)
    slots, inner, rank, width = np.array(rows), 40, 8, 24
    rng = np.random.default_rng(len(rows))
    a = rng.standard_normal((4, inner, rank), np.float32)
    b = rng.standard_normal((4, rank, width), np.float32)
    a[0], b[0] = 0, 0  # the base's slot
    x = rng.standard_normal((len(rows), inner), np.float32)
    product = rng.standard_normal((len(rows), width + 10), np.float32)
    want = np.array(ReferenceOps().low_rank(mx.array(x)[:, None], mx.array(a), mx.array(b),
                                            mx.array(slots)))[:, 0]
    got = product.copy()
    cpu_threads.run(cpu_low_rank.add, x, got[:, 5:5 + width], cpu_low_rank.host_pair(a, b),
                    cpu_low_rank.host_rows(slots))
    np.testing.assert_allclose(got[:, 5:5 + width], product[:, 5:5 + width] + want,
                               atol=1e-4, rtol=1e-5)
    np.testing.assert_array_equal(got[:, :5], product[:, :5])  # nothing outside its columns
    np.testing.assert_array_equal(got[:, 5 + width:], product[:, 5 + width:])


def host_and_reference_logits(runner, out) -> tuple[np.ndarray, np.ndarray]:
    """The step's logits under the host ops, then (the same K/V written again) the reference's."""
    logits = []
    for ops in ("host", "reference"):
        runner.model.use_ops(ops)
        logits.append(np.array(runner.forward_logits(out)))
    runner.model.use_ops("host")
    return logits[0], logits[1]


@pytest.mark.parametrize("stacked", [True, False], ids=["all-layers", "a-layer-at-a-time"])
def test_host_layer_steps_serve_a_mixed_batch_as_the_reference(family, stacked,  # noqa: F811
                                                               monkeypatch):
    """A short prefill of three adapters' requests and the base's, their decode steps, then a
    request after an unload moved its adapter to another slot: the reference's logits, every
    step on the host's compiled layer steps with its adapter rows."""
    if stacked:
        steps = count_calls(monkeypatch, cpu_layer, "step_layers")
    else:
        monkeypatch.setattr(HostStack, "step", lambda self, *args: None)
        steps = count_calls(monkeypatch, host_forward, "layer_step")
    runner, scheduler = serving(family)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, name in enumerate([*ADAPTERS, None]):
        scheduler.add_request(Request(f"{name}", PROMPT[i:i + 12], params, lora_name=name))
    serve_comparing(runner, scheduler, steps)
    runner.adapters.unload("r4")  # r8 and attn move down a slot
    scheduler.add_request(Request("r8 again", PROMPT[:5], params, lora_name="r8"))
    serve_comparing(runner, scheduler, steps)


def serve_comparing(runner, scheduler, steps: list[tuple]) -> None:
    """Every step until all requests finish: the host's logits equal the reference's, and
    the host's compiled steps (`steps`: their calls' arguments) took the adapter rows."""
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        steps.clear()
        host, reference = host_and_reference_logits(runner, out)
        np.testing.assert_allclose(host, reference, atol=1e-4, rtol=0)
        # step_layers(..., lora_rows), layer_step(..., lora): this step's adapter rows
        adapter_rows = sum(len(s.token_ids) for s in out.scheduled if s.lora_name)
        assert steps and {len(host_rows(args[-1])[0]) for args in steps} == {adapter_rows}
        run_step(runner, scheduler, out)


def host_rows(lora) -> tuple[np.ndarray, np.ndarray]:
    return lora.rows if isinstance(lora, host_forward.HostLora) else lora
