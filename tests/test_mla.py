"""Multi-head latent attention (DeepSeek V3's family) over its latent pool: exact against
transformers without a q low rank and with the rope dims paired or not, through prefix-cache
hits (short and long chunks after them), preemption and the disk tier's round trip; the pool
holds one row of latent and rope key per token and no values."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import generate_greedy, greedy_after_preemptions, make_runner_and_scheduler
from mlx.utils import tree_flatten
from test_model_parity import TOL, random_ids, run_logits, torch_logits
from tiny_models import build_tiny_model, hf_greedy, save_word_tokenizer

from convert import convert_model
from metal_engine.cache.cache_plan import group_bytes
from metal_engine.cache.kv_cache import KVCache
from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.mla_forms import FormCosts
from scheduler import SamplingParams

LATENT = 32 + 8  # the tiny config's kv_lora_rank + qk_rope_head_dim


@pytest.mark.parametrize("interleave", [True, False], ids=["paired-rope", "halves-rope"])
def test_queries_without_a_low_rank_match_transformers(tmp_path, interleave):
    model = build_tiny_model("deepseek_v3", tmp_path / "hf", q_lora_rank=None,
                             rope_interleave=interleave,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    path = convert_model(tmp_path / "hf", tmp_path / "model", progress=False)
    runner, scheduler = make_runner_and_scheduler(path, block_size=8)
    ids = random_ids(3, 30)
    got = run_logits(runner, scheduler, "a", ids, chunk=7)
    np.testing.assert_allclose(got, torch_logits(model, ids), atol=TOL, rtol=TOL)


def test_the_pool_keeps_one_latent_row_per_token_and_no_values(tiny_deepseek):
    _, path = tiny_deepseek
    cfg = ModelConfig.from_model_dir(path)
    assert cfg.kv_pool_shapes() == [(1, LATENT)] * cfg.num_hidden_layers
    per_block = group_bytes(cfg, mx.float16, 16, 4, 64).bytes_per_block
    assert per_block == cfg.num_hidden_layers * 16 * LATENT * 2  # no V: once, not twice
    runner, _ = make_runner_and_scheduler(path)
    cache: KVCache = runner.cache
    assert all(v is None for v in cache.v) and cache.kind == cfg.kv_kind == "latent"
    assert cache.bytes_per_block(cache.kind) == cfg.num_hidden_layers * 16 * LATENT * 4


def test_latent_blocks_round_trip_through_their_payloads(tiny_deepseek):
    _, path = tiny_deepseek
    runner, scheduler = make_runner_and_scheduler(path, block_size=8)
    run_logits(runner, scheduler, "a", random_ids(1, 24), chunk=24)
    cache: KVCache = runner.cache
    layout = cache.groups()["latent"].layout
    payloads = cache.read_blocks([0, 1], cache.kind)
    assert len(payloads[0]) == layout.payload_bytes == cache.bytes_per_block(cache.kind)
    cache.write_blocks([5, 6], payloads, cache.kind)
    assert cache.read_blocks([5, 6], cache.kind) == payloads and payloads[0] != payloads[1]


def test_preempted_requests_resume_exactly(tiny_deepseek):
    model, path = tiny_deepseek
    rng = np.random.default_rng(4)
    asked = {f"r{i}": [int(t) for t in rng.integers(3, 128, size=15 + 4 * i)] for i in range(5)}
    # Together the requests need ~20 blocks of 8; the pool has 10.
    served = greedy_after_preemptions(path, asked, num_blocks=10)
    assert served == {rid: hf_greedy(model, ids, 10) for rid, ids in asked.items()}


def served_engine(path, tokenizer, tmp_path, **options):
    """An engine of the model dir `path` with `tokenizer`'s files beside it (copied into
    `tmp_path` once), as `serve` builds one with `options`."""
    import shutil

    served = tmp_path / "model"
    if not served.exists():
        shutil.copytree(path, served)
        tokenizer.save_pretrained(served)
    return build_engine(EngineConfig(model_dir=served, dtype="float32", max_num_seqs=4,
                                     kv_cache_memory=1 << 22, **options))


def test_the_engines_scheduler_and_pools_keep_tokens_as_latent_blocks(tiny_deepseek,
                                                                     default_tokenizer, tmp_path):
    """MLA's cache kind from the model config to both sides: the scheduler's anchor group is
    a LatentGroup, the runner's pools are of its kind (no values) and so are the tier's."""
    from scheduler.cache_groups.latent import LatentGroup

    _, path = tiny_deepseek
    engine = served_engine(path, default_tokenizer, tmp_path)
    anchor = engine.scheduler.groups[0]
    assert isinstance(anchor, LatentGroup) and engine.scheduler.pool is anchor.pool
    cache: KVCache = engine.runner.cache
    assert anchor.kind == cache.kind == "latent" and list(cache.groups()) == ["latent"]
    assert all(v is None for v in cache.v) and not cache.groups()["latent"].layout.values


def test_the_engine_serves_prefix_hits_exactly(tiny_deepseek, default_tokenizer, tmp_path):
    model, path = tiny_deepseek
    engine = served_engine(path, default_tokenizer, tmp_path)
    shared = random_ids(9, 40)
    # The second's 2 new rows attend absorbed over the hit, the third's 40 expanded.
    asked = {"first": shared + [5, 6, 7], "second": shared + [8, 9],
             "third": shared + random_ids(10, 40)}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    cached = {}
    for rid, ids in asked.items():  # one after the other: the second hits the first's blocks
        engine.add_request(rid, ids, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                got.setdefault(rid, []).extend(output.new_token_ids)
                cached[rid] = output.num_cached_tokens
    assert cached["second"] >= 32 and cached["third"] >= 32
    costs = FormCosts.of(ModelConfig.from_model_dir(path).mla)
    rows = np.array([len(asked[rid]) - cached[rid] for rid in ("second", "third")])
    assert costs.expands(rows, [len(asked["second"]), len(asked["third"])]).tolist() == [
        False, True]
    for rid, ids in asked.items():
        assert got[rid] == hf_greedy(model, ids, 8), rid


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_restarted_engine_loads_the_latent_prefix_from_disk(tiny_deepseek, default_tokenizer,
                                                              tmp_path, kv_cache_dtype):
    """With a KV cache dir the first engine saves its latent blocks at close; a restarted one
    finds the prompt's 5 full blocks stored, loads them as they were (an int8 pool's codes and
    scales too) and serves the tokens it served before: transformers' in float."""
    from test_kv_disk_cache_engine import PROMPT, assert_same_prefix_kv, cached_contents, generate

    model, path = tiny_deepseek

    def restarted() -> LLMEngine:
        return served_engine(path, default_tokenizer, tmp_path, block_size=8,
                             kv_cache_dir=tmp_path / "kv", kv_cache_dtype=kv_cache_dtype)

    first = restarted()
    tokens, cached = generate(first, "first")
    blocks = cached_contents(first)
    first.close()
    assert cached == 0 and any(f.suffix == ".kvb" for f in (tmp_path / "kv").rglob("*"))
    again = restarted()
    assert generate(again, "again") == (tokens, 5 * 8)
    assert again.scheduler.prefix_cache.stats.stored_hit_tokens == 5 * 8
    assert_same_prefix_kv(again, (tokens, blocks))
    if kv_cache_dtype == "auto":
        assert tokens == hf_greedy(model, PROMPT, 6)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_latent_pool_stays_near_the_float_one(tiny_deepseek, bits):
    """Latent rows stored as int8/int4 codes and scales (not turned: their values are a part
    of them), attended through the reference here."""
    from kernels_metal.kv_quant import KVQuant, QuantizedPool

    _, path = tiny_deepseek
    ids = random_ids(6, 30)
    exact = run_logits(*make_runner_and_scheduler(path, block_size=8), "a", ids, chunk=7)
    runner, scheduler = make_runner_and_scheduler(path, block_size=8, kv_quant=KVQuant(bits))
    pool = runner.cache.k[0]
    assert isinstance(pool, QuantizedPool) and not pool.rotated and runner.cache.v[0] is None
    got = run_logits(runner, scheduler, "a", ids, chunk=7)
    error = np.abs(got - exact).max() / np.abs(exact).max()
    # Tiny random models are hard on int4 anyway (Qwen3's turned keys: 0.18 here); latent
    # rows are not turned, their outliers not spread.
    assert 0 < error < (0.02 if bits == 8 else 0.5), error


@pytest.mark.parametrize(("config_class", "layers", "fits_on"), [
    ("DeepseekV3Config", 61, ()),  # 671B parameters: no Mac holds them in bfloat16
    ("Glm4MoeLiteConfig", 47, (128,)),  # GLM-4.7-Flash, 30B-A3B
])  # fmt: skip
def test_dry_run_of_published_mla_configs_plans_their_latent_pool(tmp_path, capsys,
                                                                  config_class, layers,
                                                                  fits_on):
    """transformers' defaults for these classes are the published checkpoints' configs."""
    import json

    import transformers

    from metal_engine.cache.memory_plan import MAC_SIZES_GB
    from server.cli import main

    published = getattr(transformers, config_class)().to_dict()
    published["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(published))
    main(["serve", "--dry-run", str(tmp_path)])
    out = capsys.readouterr().out
    per_token = layers * LATENT_WIDTH_PUBLISHED * 2  # one bfloat16 latent row per layer
    assert f"bfloat16, {per_token / 1024:.1f} KiB a token" in out
    for gb in MAC_SIZES_GB:
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{gb} GB Mac"))
        assert ("does not fit" not in line) == (gb in fits_on), line


LATENT_WIDTH_PUBLISHED = 512 + 64  # kv_lora_rank + qk_rope_head_dim of both


@pytest.mark.parametrize("bits", [None, 4, 8], ids=["float", "4-bit", "8-bit"])
def test_an_mlx_lm_checkpoint_with_kv_b_proj_split_loads_and_matches_mlx_lm(tmp_path, bits):
    """mlx-lm's own conversion (its `sanitize` splits kv_b_proj into embed_q / unembed_out,
    its `quantize_model` quantizes what its rules say) loads here and gives mlx-lm's logits."""
    import json
    import shutil

    from mlx_lm import utils as mlx_lm_utils

    from metal_engine.loading.weights import load_model

    # Default rope: mlx-lm's YaRN departs from transformers' at the tiny config's factor.
    build_tiny_model("deepseek_v3", tmp_path / "hf",
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    theirs, config = mlx_lm_utils.load_model(tmp_path / "hf")
    if bits is not None:
        theirs, config = mlx_lm_utils.quantize_model(theirs, config, group_size=32, bits=bits)
    out = tmp_path / "mlx-lm"
    mlx_lm_utils.save_model(out, theirs)
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(tmp_path / "hf" / "tokenizer.json", out)
    assert "model.layers.1.self_attn.unembed_out.weight" in mx.load(str(out / "model.safetensors"))

    ids = random_ids(2, 24)
    expected = np.array(theirs(mx.array([ids]))[0].astype(mx.float32))
    runner, scheduler = make_runner_and_scheduler(out, block_size=8)
    got = run_logits(runner, scheduler, "a", ids, chunk=24)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert "kv_b_proj" in dict(load_model(out, mx.float32).model.layers[1].self_attn.children())


def test_a_quantized_kv_b_proj_is_absorbed_as_its_dequantized_weight(tmp_path, monkeypatch):
    """On a Mac quantized layers stay quantized: the attention dequantizes kv_b_proj once to
    absorb it, and gives what the CPU backend's load-time dequantization gives."""
    import mlx.nn as nn

    from metal_engine.loading import weights

    build_tiny_model("deepseek_v3", tmp_path / "hf")
    path = convert_model(tmp_path / "hf", tmp_path / "q4", quantize=4, group_size=32,
                         progress=False)
    ids = random_ids(4, 20)
    dequantized = run_logits(*make_runner_and_scheduler(path, block_size=8), "a", ids, 20)
    monkeypatch.setattr(weights, "keeps_quantized", lambda: True)
    runner, scheduler = make_runner_and_scheduler(path, block_size=8)
    assert isinstance(runner.model.model.layers[1].self_attn.kv_b_proj, nn.QuantizedLinear)
    got = run_logits(runner, scheduler, "a", ids, chunk=20)
    np.testing.assert_allclose(got, dequantized, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(float torch model, its FP8 checkpoint, a float checkpoint of the FP8 one's dequantized
    weights, those weights): DeepSeek's published layout, e4m3 weights with a float32 scale
    per block (16 x 16 here, so that the tiny matrices span several blocks and partial ones)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("fp8")
    source = root / "hf"
    model = build_tiny_model("deepseek_v3", source)
    block = 16
    stored, expected = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if tensor.ndim != 2 or not name.endswith("proj.weight"):
            stored[name] = expected[name] = tensor
            continue
        rows, columns = -(-tensor.shape[0] // block), -(-tensor.shape[1] // block)
        padded = torch.zeros(rows * block, columns * block)
        padded[: tensor.shape[0], : tensor.shape[1]] = tensor
        blocks = padded.reshape(rows, block, columns, block)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # e4m3's largest value
        codes = (blocks / scale[:, None, :, None]).reshape(padded.shape)
        codes = codes[: tensor.shape[0], : tensor.shape[1]].to(torch.float8_e4m3fn)
        stored[name], stored[name + "_scale_inv"] = codes, scale
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        expected[name] = codes.float() * full[: tensor.shape[0], : tensor.shape[1]]
    fp8 = root / "fp8"
    fp8.mkdir()
    save_file(stored, fp8 / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (fp8 / "config.json").write_text(json.dumps(config))
    dequantized = root / "dequantized"
    dequantized.mkdir()
    save_file({k: v.contiguous() for k, v in expected.items()},
              dequantized / "model.safetensors")
    shutil.copy(source / "tokenizer.json", fp8)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(source / name, dequantized)
    return model, fp8, dequantized, expected


def test_an_fp8_block_quantized_checkpoint_converts_to_its_dequantized_weights(fp8_checkpoint,
                                                                               tmp_path):
    from metal_engine.loading.weights import load_model

    model, fp8, dequantized, expected = fp8_checkpoint
    with pytest.raises(ValueError, match="FP8 checkpoint .* convert it first"):
        load_model(fp8, mx.float32)
    out = convert_model(fp8, tmp_path / "out", progress=False)
    converted = load_model(out, mx.float32)
    params = dict(tree_flatten(converted.parameters()))
    for name in ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.2.self_attn.q_a_proj.weight"):
        np.testing.assert_array_equal(np.array(params[name]), expected[name].numpy())
    # The same as a float checkpoint of the dequantized weights, and near the float source.
    ids = random_ids(3, 20)
    logits = {name: run_logits(*make_runner_and_scheduler(path, block_size=8), "a", ids, 20)
              for name, path in (("fp8", out), ("dequantized", convert_model(
                  dequantized, tmp_path / "d", progress=False)))}
    np.testing.assert_allclose(logits["fp8"], logits["dequantized"], atol=1e-5, rtol=1e-5)
    exact = torch_logits(model, ids)
    error = np.abs(logits["fp8"] - exact).max() / np.abs(exact).max()
    # e4m3 keeps 4 significant bits: a tiny random model's logits move by 7% of the largest.
    assert 0 < error < 0.15, error


@pytest.mark.parametrize("bits", [8, 4])
def test_an_fp8_checkpoint_quantized_at_conversion_is_its_dequantized_weights_quantized(
        fp8_checkpoint, tmp_path, bits):
    """`--quantize 8|4` of an FP8 checkpoint: its weights dequantized, then MLX's affine
    quantization, exactly as of a float checkpoint of those weights; the error over
    transformers' float model is FP8's and the quantization's together."""
    model, fp8, dequantized, _ = fp8_checkpoint
    ids = random_ids(3, 20)
    logits = {name: run_logits(*make_runner_and_scheduler(convert_model(
        path, tmp_path / name, progress=False, quantize=bits, group_size=32), block_size=8),
        "a", ids, 20) for name, path in (("fp8", fp8), ("dequantized", dequantized))}
    np.testing.assert_allclose(logits["fp8"], logits["dequantized"], atol=1e-5, rtol=1e-5)
    exact = torch_logits(model, ids)
    error = np.abs(logits["fp8"] - exact).max() / np.abs(exact).max()
    # 6.6% of the largest logit at 8 bits (e4m3's 7% dominates: 8 bits alone move a float
    # source's by 1.4%), 26% at 4 bits (as 4 bits alone do); docs/models.md states them.
    assert 0 < error < (0.15 if bits == 8 else 0.5), error


def test_a_warmed_up_server_streams_an_mla_models_greedy_tokens(tiny_deepseek, default_tokenizer,
                                                                 tmp_path):
    """The whole stack: the warm-up, the engine thread and a real server, with the official
    client streaming a completion of token ids."""
    import openai
    from server_helpers import running_server

    from metal_engine.warm_up import warm_up

    model, path = tiny_deepseek
    engine = served_engine(path, default_tokenizer, tmp_path)
    warm_up(engine)
    ids = random_ids(8, 12)
    with running_server(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        stream = client.completions.create(model="default", prompt=ids, max_tokens=6,
                                           temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == default_tokenizer.decode(hf_greedy(model, ids, 6), skip_special_tokens=True)


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory):
    """(Kimi K2.5's multimodal torch model, its text model converted): a vision tower beside
    Kimi K2's DeepSeek V3."""
    import torch
    from test_convert_families import _kimi_k25_multimodal

    torch.manual_seed(0)
    model = _kimi_k25_multimodal().eval()
    root = tmp_path_factory.mktemp("kimi_k25")
    model.save_pretrained(root / "hf")
    save_word_tokenizer(root / "hf")
    return model, convert_model(root / "hf", root / "model", progress=False)


def test_kimi_k25s_text_model_serves_transformers_greedy_tokens(kimi_k25):
    """Kimi K2.5's checkpoint converts to its text model, whose served tokens are the
    multimodal model's on a text prompt."""
    model, path = kimi_k25
    prompts = {"a": random_ids(11, 30), "b": random_ids(12, 5)}
    got = generate_greedy(*make_runner_and_scheduler(path, block_size=8), prompts, 8)
    for rid, ids in prompts.items():
        assert got[rid] == hf_greedy(model, ids, 8), rid


@pytest.mark.parametrize(("block_size", "chunk"), [(16, 45), (16, 7), (8, 1)],
                         ids=["whole-prompt", "chunked", "token-by-token"])
def test_kimi_k25s_text_model_gives_transformers_logits(kimi_k25, block_size, chunk):
    """The multimodal model's logits on a text prompt, at every position, fed whole, in
    chunks and token by token."""
    model, path = kimi_k25
    runner, scheduler = make_runner_and_scheduler(path, block_size=block_size)
    ids = random_ids(chunk, 45)
    got = run_logits(runner, scheduler, "a", ids, chunk=chunk)
    np.testing.assert_allclose(got, torch_logits(model, ids), atol=TOL, rtol=TOL)
