"""The CPU backend's host forward (kernels_metal/cpu/host_forward.py): layers on numpy arrays
give the MLX path's logits (long prefill chunks' attention in cpu_prefill included), layers of a few
rows in compiled calls (kernels_metal/cpu/layer: all of them in one, or one in two) give the
module-by-module numbers, and q/k/v and gate/up are packed without copies."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import make_runner_and_scheduler
from mlx.utils import tree_unflatten
from test_model_parity import random_ids, run_logits
from tiny_models import build_tiny_model

import kernels_metal.cpu.host_forward as host
from convert import convert_model
from kernels_metal.cpu import layer as cpu_layer
from kernels_metal.cpu import layer_arrays
from kernels_metal.cpu import prefill as cpu_prefill
from kernels_metal.cpu import threads as cpu_threads
from kernels_metal.cpu.host_forward import HostStack

FAMILIES = ["llama", "qwen2", "qwen3", "phi3"]  # plain, q/k/v biases, q/k norms, fused
# Whose layers step in one call: the tiny qwen2 mixes sliding-window and full layers, whose
# attention rows differ, so its layers go one at a time.
STACKED = {"llama", "qwen3", "phi3"}


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory):
    source = tmp_path_factory.mktemp(f"{request.param}-hf")
    build_tiny_model(request.param, source)
    return convert_model(source, tmp_path_factory.mktemp(f"{request.param}-model") / "model",
                         progress=False)


def logits(model_dir, ids, chunk, on_host: bool, monkeypatch) -> tuple[np.ndarray, list[bool]]:
    monkeypatch.setattr(host, "numpy_serves", lambda: on_host)
    runner, scheduler = make_runner_and_scheduler(model_dir)
    got = run_logits(runner, scheduler, "a", ids, chunk=chunk)
    decoder = runner.model.model
    return got, runner.model.ops.plan.layers_on_host(decoder.layers, runner.cache)


@pytest.mark.parametrize(("chunk", "length"), [(45, 45), (5, 45), (1, 45), (100, 200)],
                         ids=["prefill", "few-rows", "decode", "long-chunks"])
def test_host_layers_give_the_mlx_logits(model_dir, chunk, length, monkeypatch):
    ids = random_ids(3, length)
    on_mlx, plan_off = logits(model_dir, ids, chunk, False, monkeypatch)
    folded = count_calls(monkeypatch, cpu_prefill, "attend")
    on_host, plan_on = logits(model_dir, ids, chunk, True, monkeypatch)
    assert not any(plan_off) and all(plan_on)
    # Chunks of 100 rows over 100 and 200 keys: past what cpu_decode's rows take.
    assert bool(folded) == (chunk == 100)
    np.testing.assert_allclose(on_host, on_mlx, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk", [7, 1, 45], ids=["few-rows", "decode", "tiled-rows"])
def test_compiled_steps_give_the_module_path_numbers(model_dir, chunk, threads, monkeypatch):
    """All layers in one call (the host stack), a layer in two calls, and module by module:
    the same numbers (45 rows: past BLAS's old share of the products)."""
    monkeypatch.setattr(cpu_threads, "_threads", threads)
    ids = random_ids(4, max(21, chunk + 5))
    stacked_steps = count_calls(monkeypatch, cpu_layer, "step_layers")
    stacked, _ = logits(model_dir, ids, chunk, True, monkeypatch)
    stacked_rows = {len(args[0]) for args in stacked_steps}  # step_layers(x, ...)
    assert (chunk in stacked_rows) == (model_dir.parent.name.split("-model")[0] in STACKED)
    monkeypatch.setattr(HostStack, "step", lambda self, *args: None)
    layer_steps = count_calls(monkeypatch, host, "layer_step")
    by_layer, _ = logits(model_dir, ids, chunk, True, monkeypatch)
    assert layer_steps
    monkeypatch.setattr(layer_arrays, "_has_step", lambda layer: False)
    modules, _ = logits(model_dir, ids, chunk, True, monkeypatch)
    np.testing.assert_allclose(stacked, modules, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(by_layer, modules, atol=1e-6, rtol=1e-6)


def count_calls(monkeypatch, owner, name: str) -> list[tuple]:
    """A list that gets the arguments of each call of `owner.name` from now on."""
    calls, function = [], getattr(owner, name)

    def counted(*args):
        calls.append(args)
        return function(*args)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_packing_makes_views(tmp_path, monkeypatch):
    source = tmp_path / "hf"
    build_tiny_model("llama", source)
    model_dir = convert_model(source, tmp_path / "model", progress=False)
    monkeypatch.setattr(host, "numpy_serves", lambda: True)
    runner, scheduler = make_runner_and_scheduler(model_dir)
    ids = random_ids(5, 20)
    run_logits(runner, scheduler, "a", ids, chunk=20)
    attn = runner.model.model.layers[0].self_attn
    q, k, v = (np.asarray(attn[name].weight) for name in ("q_proj", "k_proj", "v_proj"))
    # one buffer: each weight starts where the one before ends
    assert k.ctypes.data == q.ctypes.data + q.nbytes
    assert v.ctypes.data == k.ctypes.data + k.nbytes



def test_replaced_weights_are_packed_again(tmp_path, monkeypatch):
    """New q/k/v weights after a host step (as load_weights sets them): the next host step
    packs and uses them, and gives the MLX path's logits."""
    source = tmp_path / "hf"
    build_tiny_model("llama", source)
    model_dir = convert_model(source, tmp_path / "model", progress=False)
    monkeypatch.setattr(host, "numpy_serves", lambda: True)
    runner, scheduler = make_runner_and_scheduler(model_dir, enable_prefix_caching=False)
    ids = random_ids(5, 20)
    before = run_logits(runner, scheduler, "a", ids, chunk=20)
    scheduler.finish_request("a", "abort")  # fed, never sampled: out of the next runs' way
    attn = runner.model.model.layers[0].self_attn
    runner.model.update(tree_unflatten([
        (f"model.layers.0.self_attn.{name}.weight", attn[name].weight * 0.5)
        for name in ("q_proj", "k_proj", "v_proj")]))
    on_host = run_logits(runner, scheduler, "b", ids, chunk=20)
    scheduler.finish_request("b", "abort")
    monkeypatch.setattr(host, "numpy_serves", lambda: False)
    on_mlx = run_logits(runner, scheduler, "c", ids, chunk=20)
    assert np.abs(on_host - before).max() > 1e-3  # the new weights are in use
    np.testing.assert_allclose(on_host, on_mlx, atol=2e-5, rtol=2e-5)


def test_pool_views_are_dropped_before_the_pools_change(tmp_path, monkeypatch):
    """The host stack's views pin the pools' buffers: writing blocks (a prefix read back from
    disk) or taking a pool drops them, so MLX writes in place and the next step views anew."""
    source = tmp_path / "hf"
    build_tiny_model("llama", source)
    model_dir = convert_model(source, tmp_path / "model", progress=False)
    monkeypatch.setattr(host, "numpy_serves", lambda: True)
    runner, scheduler = make_runner_and_scheduler(model_dir)
    run_logits(runner, scheduler, "a", random_ids(6, 12), chunk=1)
    scheduler.finish_request("a", "abort")  # fed, never sampled: out of the next run's way
    cache = runner.cache
    assert cache.host_views is not None
    cache.write_blocks([1], cache.read_blocks([1], cache.kind), cache.kind)
    assert cache.host_views is None
    run_logits(runner, scheduler, "b", random_ids(7, 12), chunk=1)
    assert cache.host_views is not None
    cache.put(0, *cache.take(0))
    assert cache.host_views is None
