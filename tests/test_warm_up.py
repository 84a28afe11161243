"""The warm-up before the server is up: the steps it makes, what it leaves untouched (the
engine's scheduler, prefix cache and disk tier), and that serving after it meets no kernel
launch it did not already compile and check."""

from __future__ import annotations

import json
import logging

import mlx.core as mx
import numpy as np
import pytest
from markers import requires_emulator
from tiny_models import build_tiny_model
from tiny_server import CHAT_TEMPLATE

from kernels_metal import attention, emulator
from kernels_metal import gated_delta as gd
from kernels_metal.fallbacks import all_fallbacks
from kernels_metal.paged import PagedAttentionKernels
from kernels_metal.plan import DECODE_MAX_QUERY_LEN
from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from metal_engine.warm_up import warm_up
from scheduler import SamplingParams

MAX_MODEL_LEN = 1024  # room for a context past one split-K partition (see the serving test)


def tiny_engine(path, model_type: str = "llama", **config) -> LLMEngine:
    build_tiny_model(model_type, path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return build_engine(EngineConfig(
        model_dir=path, max_model_len=MAX_MODEL_LEN, allow_long_max_model_len=True,
        kv_cache_memory=16 << 20, **config))  # fmt: skip


def launched_steps(engine, monkeypatch) -> list:
    """The SchedulerOutput of every step `engine`'s runner launches from now on."""
    steps, launch = [], engine.runner.launch

    def recording(out, *args, **kwargs):
        steps.append(out)
        return launch(out, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", recording)
    return steps


def is_decode(row) -> bool:
    return len(row.token_ids) == 1 and row.num_output_tokens > 0


def serve(engine, prompts: list[list[int]], max_tokens: int = 5) -> list[list[int]]:
    """Greedy outputs of `prompts`, all added at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    return list(outputs.values())


def test_the_warm_up_makes_every_kind_of_step(tmp_path, monkeypatch):
    engine = tiny_engine(tmp_path)
    steps = launched_steps(engine, monkeypatch)
    warm_up(engine)
    rows = [s.scheduled for s in steps]
    split = [([r for r in step if not is_decode(r)], [r for r in step if is_decode(r)])
             for step in rows]
    prefills = [p for p, _ in split]
    assert any(len(p) >= 7 and not d and all(len(r.token_ids) > DECODE_MAX_QUERY_LEN
                                              for r in p) for p, d in split)
    assert any(len(d) >= 7 and not p for p, d in split)  # decode-only
    assert any(p and d for p, d in split)  # mixed
    assert any(r.start_position > 0 for p in prefills for r in p)  # prefill over a context
    assert any(len(d) == 1 and not p for p, d in split)  # one request decoding
    sampled = {(r.params.temperature > 0, r.params.top_p < 1, r.params.min_p > 0,
                r.params.repetition_penalty != 1, r.params.logprobs is not None)
               for step in rows for r in step}
    assert all(any(flags[i] for flags in sampled) for i in range(5))


def test_the_warm_up_leaves_the_engines_caches_untouched(tmp_path, monkeypatch):
    disk = tmp_path / "kv-disk"
    engine = tiny_engine(tmp_path / "model", kv_cache_dir=disk)
    files_before = sorted(p.relative_to(disk) for p in disk.rglob("*"))
    warm_up(engine)
    scheduler = engine.scheduler
    assert not engine.has_unfinished_requests() and not scheduler.requests
    assert scheduler.pool.num_used_blocks == 0 and not scheduler.pool.cached_blocks()
    assert scheduler.prefix_cache.stats.queried_tokens == 0
    assert not engine.runner.block_tables._rows  # every warm-up request released
    engine.close()  # what the disk tier would save of the pool: nothing
    assert sorted(p.relative_to(disk) for p in disk.rglob("*")) == files_before
    cold = tiny_engine(tmp_path / "cold")
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 128, n)] for n in (7, 40, 19)]
    warm = tiny_engine(tmp_path / "warm")
    warm_up(warm)
    assert serve(warm, prompts) == serve(cold, prompts)


def test_the_startup_log_names_each_fallback(tmp_path, monkeypatch, caplog):
    from server import model_loading

    dispatch = attention._Dispatch()  # verdicts as a Mac would have them after a failure
    variant = attention.Variant(mx.bfloat16, 256, 16, 8, 1)
    dispatch.verdicts.fallbacks[variant] = "RuntimeError: Unable to build metal library"
    monkeypatch.setattr(attention, "_state", dispatch)
    with caplog.at_level(logging.INFO, logger="metal_serve"):
        model_loading.warm_up(tiny_engine(tmp_path))
    summary, *warnings = [r.getMessage() for r in caplog.records if r.name == "metal_serve"]
    assert summary.startswith("warm-up: ") and summary.endswith("kernel fallbacks: 1")
    assert warnings == [f"kernel fallback: attention {variant.name} runs on the reference: "
                        "RuntimeError: Unable to build metal library"]


WORKLOAD = (1, 3, 17, 40, 64, 90, 2, 33, 5, 120)  # prompt lengths, all at once


@requires_emulator
@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_serving_after_the_warm_up_meets_no_new_kernel_launch(tmp_path, model_type):
    """Every launch configuration serving makes was compiled and checked by the warm-up
    (the dispatcher evaluates a new one inside its call: `proven` would grow)."""
    engine = tiny_engine(tmp_path, model_type)
    kernels = PagedAttentionKernels(attention._state.recorded(emulator.metal_kernel))
    scan = gd.GatedDeltaKernel(gd._state.recorded(emulator.metal_kernel))
    with (attention.use_kernels(kernels, first_use_check=True),
          gd.use_kernel(scan, first_use_check=True)):
        warm_up(engine)
        proven = {d.family: set(d.active_verdicts.proven) for d in (attention._state, gd._state)}
        rng = np.random.default_rng(11)
        serve(engine, [[int(t) for t in rng.integers(3, 128, n)] for n in WORKLOAD])
        serve(engine, [[int(t) for t in rng.integers(3, 128, 700)]], max_tokens=3)
        assert {d.family: d.active_verdicts.proven for d in (attention._state, gd._state)} == proven
        assert proven["attention"] and (model_type == "llama" or proven["gated delta"])
        assert not all_fallbacks()
