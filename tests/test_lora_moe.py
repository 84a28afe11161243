"""LoRA adapters over a MoE base (Qwen3-MoE), the experts' projections adapted too: parity
with transformers + PEFT (which adapts transformers' fused experts through
`target_parameters`), the same weights in PEFT's per-expert and mlx-lm's layouts, mixed
batches, and a quantized base."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from engine_helpers import make_runner_and_scheduler
from lora_files import (
    ATTENTION,
    save_peft_adapter,
    torch_greedy,
    torch_logits,
    write_mlx_lm_files,
    write_peft_files,
)
from safetensors.numpy import load_file
from test_lora import PROMPT, generate, prompt_logits
from tiny_models import build_tiny_model

from convert import convert_model
from metal_engine.loading import weights
from metal_engine.lora.adapter_files import load_adapter
from metal_engine.lora.slots import AdapterSlots
from metal_engine.models.layers import QuantizedLinear
from metal_engine.models.moe import QuantizedSwitchLinear

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# name -> (rank, seed, target_modules, target_parameters, rsLoRA): two ranks, and one
# adapting attention and the experts' down projections alone
ADAPTERS = {"r4": (4, 11, None, EXPERTS, False), "r8": (8, 12, None, EXPERTS, True),
            "down": (4, 13, ATTENTION, ["mlp.experts.down_proj"], False)}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(model dir, {adapter name: (dir, PEFT model)}, base torch model)."""
    root = tmp_path_factory.mktemp("qwen3_moe")
    base = build_tiny_model("qwen3_moe", root / "hf")
    model_dir = convert_model(root / "hf", root / "model", progress=False)
    adapters = {}
    for name, (rank, seed, targets, parameters, rslora) in ADAPTERS.items():
        kwargs = {} if targets is None else {"targets": targets}
        adapters[name] = (root / name, save_peft_adapter(
            base, root / name, rank, seed, rslora=rslora, parameters=parameters, **kwargs))
    return model_dir, adapters, base


def serving(moe, names=tuple(ADAPTERS), model_dir=None, **kwargs):
    runner, scheduler = make_runner_and_scheduler(model_dir or moe[0], **kwargs)
    runner.adapters = AdapterSlots(runner.model, 4, 16)  # gate_up_proj: rank 2r
    for name in names:
        runner.adapters.load(load_adapter(name, moe[1][name][0]))
    return runner, scheduler


@pytest.mark.parametrize("ops", ["host", "reference", "metal"])
def test_expert_adapters_logits_equal_peft(moe, ops):
    runner, scheduler = serving(moe)
    runner.model.use_ops(ops)
    base = prompt_logits(runner, scheduler, "base", PROMPT, None)
    for name, (_, peft_model) in moe[1].items():
        got = prompt_logits(runner, scheduler, name, PROMPT, name)
        np.testing.assert_allclose(got, torch_logits(peft_model, PROMPT), atol=1e-4, rtol=0)
        assert np.abs(got - base).max() > 0.01


def test_mixed_batch_equals_each_alone_and_peft(moe):
    """The first step holds over 64 (row, expert) pairs (sorted by expert and adapter), the
    decode steps fewer (gathered in row order)."""
    prompts = {name: (PROMPT[i:], name) for i, name in enumerate(ADAPTERS)}
    prompts["base"] = (PROMPT[3:], None)
    together = generate(*serving(moe), prompts, 5)
    for rid, prompt in prompts.items():
        assert generate(*serving(moe), {rid: prompt}, 5)[rid] == together[rid]
        model = moe[1][prompt[1]][1] if prompt[1] else moe[2]
        assert together[rid] == torch_greedy(model, prompt[0], 5)


def per_expert_pairs(peft_dir, config) -> dict:
    """The fused-experts PEFT file's pairs in the per-expert layout (`experts.<e>.gate_proj`,
    [r, in] / [out, r], the scale folded into B): PEFT's A rows are expert-major, its B
    columns rank-major; `gate_up_proj` has its own rank and alpha (twice the others)."""
    tensors = load_file(peft_dir / "adapter_model.safetensors")
    adapter = json.loads((peft_dir / "adapter_config.json").read_text())
    experts, inner = config.num_experts, config.moe_intermediate_size
    pairs = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        if ".experts" not in module:
            pairs[module] = (a, b * adapter["lora_alpha"] / adapter["r"])
            continue
        gate_up = a.shape[1] == config.hidden_size
        rank = len(a) // experts
        alpha = adapter["alpha_pattern"][r".*\.gate_up_proj"] if gate_up else \
            adapter["lora_alpha"]
        a3, b3 = a.reshape(experts, rank, -1), b.reshape(len(b), rank, experts) * alpha / rank
        parts = {"gate_proj": slice(0, inner), "up_proj": slice(inner, None)} if gate_up \
            else {"down_proj": slice(None)}
        for e in range(experts):
            for proj, rows in parts.items():
                pairs[f"{module.split('.base_layer')[0]}.{e}.{proj}"] = (a3[e], b3[rows, :, e])
    return pairs


def test_per_expert_and_mlx_lm_layouts_equal_the_fused_one(moe, tmp_path):
    path, peft_model = moe[1]["r4"]
    pairs = per_expert_pairs(path, moe[2].config)
    stacked = {}  # mlx-lm's: the experts' pairs stacked under switch_mlp
    for module, pair in pairs.items():
        if ".experts." in module:
            block, e, proj = module.rsplit(".", 2)
            stacked.setdefault(f"{block.removesuffix('.experts')}.switch_mlp.{proj}", {})[
                int(e)] = pair
        else:
            stacked[module] = pair
    stacked = {m: p if isinstance(p, tuple) else tuple(
        np.stack([p[e][i] for e in sorted(p)]) for i in (0, 1)) for m, p in stacked.items()}
    runner, scheduler = make_runner_and_scheduler(moe[0])
    runner.adapters = AdapterSlots(runner.model, 2, 8)
    runner.adapters.load(load_adapter("peft", write_peft_files(tmp_path / "p", pairs, 8)))
    runner.adapters.load(load_adapter("mlx", write_mlx_lm_files(tmp_path / "m", stacked, 8)))
    want = torch_logits(peft_model, PROMPT)
    for name in ("peft", "mlx"):
        np.testing.assert_allclose(prompt_logits(runner, scheduler, name, PROMPT, name), want,
                                   atol=1e-4, rtol=0)


def test_expert_pairs_of_another_base_are_refused(moe, tmp_path):
    runner, _ = make_runner_and_scheduler(moe[0])
    slots = AdapterSlots(runner.model, 2, 8)
    block = "model.layers.0.mlp.switch_mlp.down_proj"
    too_many = {block: (np.ones((5, 4, 32)), np.ones((5, 64, 4)))}  # 5 experts, the base 4
    with pytest.raises(ValueError, match=f"targets {block} with A \\(5, 4, 32\\).*4x64x32"):
        slots.load(load_adapter("e", write_mlx_lm_files(tmp_path / "e", too_many, 4)))
    shutil.copytree(moe[1]["r4"][0], tmp_path / "bias")
    config = json.loads((tmp_path / "bias" / "adapter_config.json").read_text())
    config["target_parameters"] = ["mlp.experts.gate_up_proj_bias"]
    (tmp_path / "bias" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="targets the parameters \\['gate_up_proj_bias'\\] of "
                       "model.layers.0.mlp.experts: only gate_up_proj, down_proj"):
        load_adapter("bias", tmp_path / "bias")


@pytest.mark.parametrize("ops", ["host", "metal"])
def test_quantized_base_serves_adapters_as_its_dequantized_self(moe, tmp_path, monkeypatch,
                                                                 ops):
    """An 8-bit base kept quantized (QuantizedLinear, QuantizedSwitchLinear: where quantized
    kernels run; forced here on the CPU, which dequantizes at load) adds each adapter as
    the dequantized base does, under the host ops and the Metal ones."""
    quantized = convert_model(moe[0].parent / "hf", tmp_path / "q8", quantize=8,
                              group_size=32, progress=False)
    prompts = {name: (PROMPT[i:], name) for i, name in enumerate(ADAPTERS)}
    prompts["base"] = (PROMPT[3:], None)
    runner, scheduler = serving(moe, model_dir=quantized)
    want = {name: prompt_logits(runner, scheduler, name, PROMPT, name) for name in ADAPTERS}
    tokens = generate(runner, scheduler, prompts, 4)

    monkeypatch.setattr(weights, "keeps_quantized", lambda: True)
    runner, scheduler = serving(moe, model_dir=quantized)
    runner.model.use_ops(ops)
    adapted = {type(m) for _, m in runner.model.named_modules()
               if getattr(m, "lora", None) is not None}
    assert adapted == {QuantizedLinear, QuantizedSwitchLinear}
    for name, logits in want.items():
        np.testing.assert_allclose(prompt_logits(runner, scheduler, name, PROMPT, name), logits,
                                   atol=1e-4, rtol=1e-4)
    assert generate(runner, scheduler, prompts, 4) == tokens


def test_gpt_oss_fused_experts_are_refused_by_name(tmp_path):
    """GPT-OSS's gate_up_proj interleaves gate and up: PEFT's pairs over its fused experts
    are refused naming them, while an adapter of its attention serves as PEFT computes."""
    base = build_tiny_model("gpt_oss", tmp_path / "hf")
    model_dir = convert_model(tmp_path / "hf", tmp_path / "model", progress=False)
    for name, parameters in [("fused", EXPERTS), ("down", ["mlp.experts.down_proj"])]:
        save_peft_adapter(base, tmp_path / name, 4, 1, targets=ATTENTION, parameters=parameters)
    attention = save_peft_adapter(base, tmp_path / "attn", 4, 2, targets=ATTENTION)
    runner, scheduler = make_runner_and_scheduler(model_dir)
    runner.adapters = AdapterSlots(runner.model, 2, 16)
    for name in ("fused", "down"):
        with pytest.raises(ValueError, match=f"adapter '{name}' targets model.layers.0.mlp."
                           "experts \\(PEFT's fused gate_up_proj / down_proj\\): GPT-OSS's "
                           "fused experts take no adapters"):
            runner.adapters.load(load_adapter(name, tmp_path / name))
    runner.adapters.load(load_adapter("attn", tmp_path / "attn"))
    np.testing.assert_allclose(prompt_logits(runner, scheduler, "attn", PROMPT, "attn"),
                               torch_logits(attention, PROMPT), atol=1e-4, rtol=0)
