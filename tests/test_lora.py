"""LoRA adapters served per request: PEFT's and mlx-lm's files, parity with PEFT over tiny
random bases, many adapters in one step, prefix caching keyed by adapter, bad adapters."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import make_runner_and_scheduler
from lora_files import (
    ATTENTION,
    save_as_mlx_lm,
    save_peft_adapter,
    torch_greedy,
    torch_logits,
    write_peft_files,
)
from scheduler_helpers import run_step
from tiny_models import build_tiny_model

from convert import convert_model
from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from metal_engine.lora.adapter_files import load_adapter
from metal_engine.lora.slots import SORTED_ROWS, AdapterSlots
from scheduler import Request, SamplingParams
from scheduler.spec_decode.config import SpeculativeConfig

PROMPT = [5, 17, 3, 99, 42, 8, 61, 23, 70, 11, 4, 90, 33, 2, 56, 7, 19, 80, 64, 1]
# name -> (rank, seed, targets, rsLoRA): two ranks, attention only and every projection
ADAPTERS = {"r4": (4, 1, None, False), "r8": (8, 2, None, True), "attn": (4, 3, ATTENTION, False)}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request, tmp_path_factory):
    """(model dir, {adapter name: (dir, PEFT model)}, base torch model) of one family."""
    root = tmp_path_factory.mktemp(request.param)
    base = build_tiny_model(request.param, root / "hf")
    model_dir = convert_model(root / "hf", root / "model", progress=False)
    adapters = {}
    for name, (rank, seed, targets, rslora) in ADAPTERS.items():
        kwargs = {} if targets is None else {"targets": targets}
        peft_model = save_peft_adapter(base, root / name, rank, seed, rslora=rslora, **kwargs)
        adapters[name] = (root / name, peft_model)
    return model_dir, adapters, base


def serving(family, max_loras=4, max_rank=8, **kwargs):
    model_dir, adapters, _ = family
    runner, scheduler = make_runner_and_scheduler(model_dir, **kwargs)
    runner.adapters = AdapterSlots(runner.model, max_loras, max_rank)
    for name, (path, _) in adapters.items():
        runner.adapters.load(load_adapter(name, path))
    return runner, scheduler


def prompt_logits(runner, scheduler, rid, ids, lora_name) -> np.ndarray:
    request = Request(rid, ids, SamplingParams(max_tokens=1), lora_name=lora_name)
    scheduler.add_request(request)
    out = scheduler.schedule()
    logits = np.array(runner.forward_logits(out).astype(mx.float32))
    scheduler.finish_request(rid, "abort")
    return logits


@pytest.mark.parametrize("ops", ["host", "reference", "metal"])
def test_logits_equal_peft(family, ops):
    runner, scheduler = serving(family)
    runner.model.use_ops(ops)
    base = prompt_logits(runner, scheduler, "base", PROMPT, None)
    np.testing.assert_allclose(base, torch_logits(family[2], PROMPT), atol=1e-4, rtol=0)
    for name, (_, peft_model) in family[1].items():
        got = prompt_logits(runner, scheduler, name, PROMPT, name)
        np.testing.assert_allclose(got, torch_logits(peft_model, PROMPT), atol=1e-4, rtol=0)
        assert np.abs(got - base).max() > 0.01  # the adapter moves the logits


def generate(runner, scheduler, prompts: dict[str, tuple[list[int], str | None]],
             max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = {rid: Request(rid, ids, params, lora_name=lora) for rid, (ids, lora) in
                prompts.items()}
    for request in requests.values():
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        run_step(runner, scheduler, scheduler.schedule())
    return {rid: r.output_token_ids for rid, r in requests.items()}


def test_one_batch_of_three_adapters_and_the_base_equals_each_alone(family):
    """Greedy tokens of a mixed batch equal PEFT's; rows of every request in one step."""
    prompts = {name: (PROMPT[i:], name) for i, name in enumerate(ADAPTERS)}
    prompts["base"] = (PROMPT[3:], None)
    runner, scheduler = serving(family)
    together = generate(runner, scheduler, prompts, 6)
    alone = {}
    for rid, prompt in prompts.items():
        runner, scheduler = serving(family)
        alone.update(generate(runner, scheduler, {rid: prompt}, 6))
    assert together == alone
    for name, (_, peft_model) in family[1].items():
        assert together[name] == torch_greedy(peft_model, prompts[name][0], 6)
    assert together["base"] == torch_greedy(family[2], prompts["base"][0], 6)


def test_rows_sorted_by_slot_in_a_long_step(family):
    """A step of many rows sorts them by adapter before the gathered products."""
    runner, scheduler = serving(family, max_num_batched_tokens=512)
    long = (PROMPT * 3)[:SORTED_ROWS]
    got = {name: prompt_logits(runner, scheduler, name, long, name) for name in ("r4", "r8")}
    for name, logits in got.items():
        np.testing.assert_allclose(logits, torch_logits(family[1][name][1], long), atol=1e-4,
                                   rtol=0)


def test_mlx_lm_adapter_equals_its_peft_original(family, tmp_path):
    path, peft_model = family[1]["r4"]
    save_as_mlx_lm(path, tmp_path / "mlx")
    runner, scheduler = make_runner_and_scheduler(family[0])
    runner.adapters = AdapterSlots(runner.model, 1, 8)
    runner.adapters.load(load_adapter("m", tmp_path / "mlx"))
    np.testing.assert_allclose(prompt_logits(runner, scheduler, "m", PROMPT, "m"),
                               torch_logits(peft_model, PROMPT), atol=1e-4, rtol=0)


def test_an_adapter_saved_by_mlx_lm_gives_mlx_lm_logits(tmp_path):
    """An adapter made by mlx-lm's tuner (`linear_to_lora_layers` over every projection of
    every layer, as `mlx_lm.lora` trains them) and saved as mlx-lm saves one (its trainable
    parameters in adapters.safetensors, its arguments in adapter_config.json) serves as
    mlx-lm's own model computes it with `load_adapters`."""
    tuner = pytest.importorskip("mlx_lm.tuner.utils")
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import load_model, save_config

    # Default rope: mlx-lm's llama3 rope departs from transformers' at the tiny config's.
    hf = tmp_path / "hf"
    build_tiny_model("llama", hf, rope_parameters=dict(rope_type="default", rope_theta=1e4))
    model_dir = convert_model(hf, tmp_path / "model", progress=False)
    trained, _ = load_model(hf)
    trained.freeze()
    args = {"fine_tune_type": "lora", "num_layers": len(trained.layers), "model": str(hf),
            "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}}
    tuner.linear_to_lora_layers(trained, args["num_layers"], args["lora_parameters"])
    mx.random.seed(7)  # mlx-lm starts lora_b at zero: random weights, as after training
    trained.update(tree_unflatten([(k, 0.1 * mx.random.normal(v.shape)) for k, v in
                                   tree_flatten(trained.trainable_parameters())]))
    out = tmp_path / "mlx-lm"
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"),
                        dict(tree_flatten(trained.trainable_parameters())))
    save_config(args, out / "adapter_config.json")

    theirs, _ = load_model(hf)
    base = np.array(theirs(mx.array([PROMPT]))[0])
    tuner.load_adapters(theirs, str(out))
    want = np.array(theirs(mx.array([PROMPT]))[0])
    runner, scheduler = make_runner_and_scheduler(model_dir)
    runner.adapters = AdapterSlots(runner.model, 1, 8)
    runner.adapters.load(load_adapter("m", out))
    got = prompt_logits(runner, scheduler, "m", PROMPT, "m")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(got - base).max() > 0.01  # the adapter counts


def test_prefix_cache_never_shares_blocks_across_adapters(family):
    runner, scheduler = serving(family, block_size=4)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    cached = {}
    for rid, lora in [("a", "r4"), ("b", "r8"), ("c", None), ("d", "r4")]:
        key = None if lora is None else runner.adapters.fingerprints[lora]
        request = Request(rid, PROMPT, params, lora_name=lora, lora_key=key)
        scheduler.add_request(request)
        while scheduler.has_unfinished_requests():
            run_step(runner, scheduler, scheduler.schedule())
        cached[rid] = request.num_cached_tokens
    assert cached == {"a": 0, "b": 0, "c": 0, "d": 16}


def test_unloading_restacks_the_remaining_adapters(family):
    runner, scheduler = serving(family)
    runner.adapters.unload("r4")
    got = prompt_logits(runner, scheduler, "r8", PROMPT, "r8")
    np.testing.assert_allclose(got, torch_logits(family[1]["r8"][1], PROMPT), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="no adapter named 'r4'"):
        prompt_logits(runner, scheduler, "gone", PROMPT, "r4")


def lora_pair(rank: int, in_features: int, out_features: int):
    return np.ones((rank, in_features)), np.ones((out_features, rank))


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(("pairs", "rank", "error"), [
    ({Q: lora_pair(16, 64, 64)}, 16, "rank 16, over --max-lora-rank 8"),
    ({Q: lora_pair(4, 32, 64)}, 4, "weight is 64x64: an adapter of another base"),
    ({"model.layers.9.self_attn.q_proj": lora_pair(4, 64, 64)}, 4,
     "which the base model does not have"),
    ({"model.embed_tokens": lora_pair(4, 128, 64)}, 4, "not on this Embedding module"),
])
def test_bad_adapters_are_refused_by_name(family, tmp_path, pairs, rank, error):
    runner, _ = make_runner_and_scheduler(family[0])
    slots = AdapterSlots(runner.model, 2, 8)
    with pytest.raises(ValueError, match=error):
        slots.load(load_adapter("bad", write_peft_files(tmp_path / "bad", pairs, rank)))
    assert slots.names == []
    slots.load(load_adapter("r4", family[1]["r4"][0]))  # a good one still loads


def test_unreadable_adapter_files_are_refused(tmp_path):
    path = write_peft_files(tmp_path / "a", {Q: lora_pair(4, 64, 64)}, 4)
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not a header")
    with pytest.raises(ValueError, match="corrupt or not safetensors"):
        load_adapter("a", path)
    (path / "adapter_config.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read .*adapter_config.json"):
        load_adapter("a", path)
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="neither adapter_model.safetensors"):
        load_adapter("a", path)


def test_an_adapter_naming_another_base_loads_with_a_warning(family, tmp_path, caplog):
    """Only a warning: a conversion renames its source, and the shapes are checked anyway."""
    engine = build_engine(EngineConfig(
        model_dir=family[0], model_name="tiny-base-8bit", max_model_len=256,
        kv_cache_memory=16 << 20, max_loras=2, max_lora_rank=8))
    pairs = {Q: lora_pair(4, 64, 64)}
    same = write_peft_files(tmp_path / "same", pairs, 4, base_model="org/Tiny-Base")
    other = write_peft_files(tmp_path / "other", pairs, 4, base_model="Qwen/Qwen3-0.6B")
    with caplog.at_level(logging.WARNING, logger="metal_engine.lora.slots"):
        engine.load_adapter("same", str(same))
        assert not caplog.records
        engine.load_adapter("other", str(other))
    assert engine.adapter_names() == ["same", "other"]
    [warning] = [r.getMessage() for r in caplog.records]
    assert "'other' names 'Qwen/Qwen3-0.6B' as its base, not the served model" in warning
    assert "tiny-base-8bit" in warning


def engine_tokens(engine, prompts: dict[str, tuple[list[int], str | None]],
                  max_tokens: int, drafts: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Each request's greedy tokens; `drafts`, if given, gets each one's verified drafts."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, (ids, lora) in prompts.items():
        engine.add_request(rid, ids, params, lora_name=lora)
    tokens = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id in tokens:  # not one aborted before
                tokens[output.request_id] += output.new_token_ids
                if drafts is not None:
                    drafts[output.request_id] = output.num_draft_tokens
    return tokens


def test_engine_serves_adapters_by_name_and_loads_them_at_run_time(family):
    model_dir, adapters, base = family
    # Suffix lookup over every request's outputs: the base's repeat the busy request's.
    spec = SpeculativeConfig.from_json('{"method": "suffix", "num_speculative_tokens": 3, '
                                      '"prompt_lookup_min": 2, "prompt_lookup_max": 3}')
    engine = build_engine(EngineConfig(
        model_dir=model_dir, max_model_len=256, kv_cache_memory=16 << 20, max_loras=2,
        max_lora_rank=8, lora_modules=(("r4", adapters["r4"][0]),), speculative_config=spec))
    repeated = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5]  # each request's own prompt offers drafts too
    # r8's files read on another thread while the engine steps (they hold no MLX array),
    # then installed between steps.
    engine.add_request("busy", repeated, SamplingParams(max_tokens=8, temperature=0.0,
                                                        ignore_eos=True))
    with ThreadPoolExecutor(1) as reader:
        read = reader.submit(engine.read_adapter, "r8", str(adapters["r8"][0]))
        while engine.has_unfinished_requests():
            engine.step()
        adapter = read.result()
    assert all(isinstance(t, np.ndarray) for pair in adapter.pairs.values() for t in pair)
    engine.install_adapter(adapter)
    assert engine.adapter_names() == ["r4", "r8"]
    prompts = {"r4": (repeated, "r4"), "r8": (repeated, "r8"), "base": (repeated, None)}
    with pytest.raises(ValueError, match="serves 1 unfinished"):
        engine.add_request("hold", PROMPT, SamplingParams(max_tokens=1), lora_name="r8")
        engine.unload_adapter("r8")
    engine.abort_request("hold")
    drafts, drafted = {}, engine.stats().spec_decode.num_draft_tokens
    got = engine_tokens(engine, prompts, 6, drafts)
    assert got == {rid: torch_greedy(adapters[lora][1] if lora else base, ids, 6)
                   for rid, (ids, lora) in prompts.items()}
    # Requests with an adapter never draft: the base's drafts are all the engine verified.
    assert drafts["base"] > 0 and drafts["r4"] == drafts["r8"] == 0
    assert engine.stats().spec_decode.num_draft_tokens - drafted == drafts["base"]
    long = list(range(3, 40))  # two full blocks
    engine_tokens(engine, {"old": (long, "r4")}, 2)
    engine.unload_adapter("r4")
    with pytest.raises(ValueError, match="no LoRA adapter named 'r4'"):
        engine.add_request("x", PROMPT, SamplingParams(max_tokens=1), lora_name="r4")
    # Other weights under a name served before: the old weights' cached blocks are not theirs.
    engine.load_adapter("r4", str(adapters["r8"][0]))
    hits = engine.stats().prefix_cache_hit_tokens
    renamed = engine_tokens(engine, {"renamed": (long, "r4")}, 2)
    assert engine.stats().prefix_cache_hit_tokens == hits
    assert renamed["renamed"] == torch_greedy(adapters["r8"][1], long, 2)
    engine_tokens(engine, {"same weights": (long, "r4")}, 2)
    assert engine.stats().prefix_cache_hit_tokens > hits  # now the same weights' blocks
    with pytest.raises(ValueError, match="over --max-lora-rank 2"):
        build_engine(EngineConfig(model_dir=model_dir, max_lora_rank=2, kv_cache_memory=16 << 20,
                                  lora_modules=(("r4", adapters["r4"][0]),)))


def test_the_disk_tier_keeps_adapters_apart(family, tmp_path):
    """Blocks an adapter stored on disk meet neither other weights loaded under its name after
    a restart nor the base; its own weights, restarted, read them back."""
    model_dir, adapters, _ = family
    long = list(range(3, 40))  # two full blocks

    def restart(weights: str):
        return build_engine(EngineConfig(
            model_dir=model_dir, max_model_len=256, kv_cache_memory=16 << 20,
            kv_cache_dir=tmp_path, max_loras=1, max_lora_rank=8,
            lora_modules=(("r4", adapters[weights][0]),)))

    first = restart("r4")
    engine_tokens(first, {"stored": (long, "r4")}, 1)
    first.close()  # saves its cached blocks to the disk tier
    other = restart("r8")  # r8's weights named r4
    engine_tokens(other, {"other weights": (long, "r4")}, 1)
    engine_tokens(other, {"base": (long, None)}, 1)
    assert other.stats().kv_disk_queried_tokens >= 2 * 32  # both asked the disk ...
    assert other.stats().kv_disk_hit_tokens == 0  # ... and found nothing of theirs
    other.close()
    again = restart("r4")
    tokens = engine_tokens(again, {"same weights": (long, "r4")}, 2)
    assert again.stats().kv_disk_hit_tokens == 32
    assert tokens["same weights"] == torch_greedy(adapters["r4"][1], long, 2)
