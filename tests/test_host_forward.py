"""The CPU backend's host forward (metal_engine/models/host.py): layers on numpy arrays give the
MLX path's logits, a layer of a few rows in compiled calls (kernels_metal/cpu_layer) gives the
module-by-module numbers, and q/k/v and gate/up are packed without copies."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import make_runner_and_scheduler
from mlx.utils import tree_unflatten
from test_model_parity import random_ids, run_logits
from tiny_models import build_tiny_model

import metal_engine.models.host as host
from convert import convert_model
from kernels_metal import cpu_threads
from metal_engine.models.layers import PreNormDecoderLayer

FAMILIES = ["llama", "qwen2", "qwen3", "phi3"]  # plain, q/k/v biases, q/k norms, fused


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory):
    source = tmp_path_factory.mktemp(f"{request.param}-hf")
    build_tiny_model(request.param, source)
    return convert_model(source, tmp_path_factory.mktemp(request.param) / "model",
                         progress=False)


def logits(model_dir, ids, chunk, on_host: bool, monkeypatch) -> tuple[np.ndarray, list[bool]]:
    monkeypatch.setattr(host, "numpy_serves", lambda: on_host)
    runner, scheduler = make_runner_and_scheduler(model_dir)
    got = run_logits(runner, scheduler, "a", ids, chunk=chunk)
    decoder = runner.model.model
    return got, decoder.host_plan.layers_on_host(decoder.layers, runner.cache)


@pytest.mark.parametrize("chunk", [45, 5, 1], ids=["prefill", "few-rows", "decode"])
def test_host_layers_give_the_mlx_logits(model_dir, chunk, monkeypatch):
    ids = random_ids(3, 45)
    on_mlx, plan_off = logits(model_dir, ids, chunk, False, monkeypatch)
    on_host, plan_on = logits(model_dir, ids, chunk, True, monkeypatch)
    assert not any(plan_off) and all(plan_on)
    np.testing.assert_allclose(on_host, on_mlx, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk", [7, 1], ids=["few-rows", "decode"])
def test_compiled_layer_steps_give_the_module_path_numbers(model_dir, chunk, threads,
                                                           monkeypatch):
    monkeypatch.setattr(cpu_threads, "_threads", threads)
    ids = random_ids(4, 21)
    steps_taken = []
    host_step = PreNormDecoderLayer._host_step

    def counted(self, *args):
        steps_taken.append(1)
        return host_step(self, *args)

    monkeypatch.setattr(PreNormDecoderLayer, "_host_step", counted)
    compiled, _ = logits(model_dir, ids, chunk, True, monkeypatch)
    assert steps_taken
    monkeypatch.setattr(PreNormDecoderLayer, "_host_steps", lambda self: False)
    modules, _ = logits(model_dir, ids, chunk, True, monkeypatch)
    np.testing.assert_allclose(compiled, modules, atol=1e-6, rtol=1e-6)


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
