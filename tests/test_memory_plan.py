"""The memory plan: which models start on which machines, what the KV cache holds, the
refusals' numbers and flags, MLX's limits, and weight bytes read without loading."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from metal_engine.cache.cache_plan import plan_cache
from metal_engine.cache.memory_plan import (
    DeviceMemory,
    MemoryRefused,
    apply_memory_limits,
    device_memory,
    headroom_bytes,
    kv_footprint,
    plan_memory,
)
from metal_engine.loading import weight_bytes
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.weight_bytes import model_dir_weight_bytes

GIB = 1 << 30
# Parameters and KV shapes (layers, KV heads, head dim) of three published models.
MODELS = {
    "0.5B": (494_000_000, 24, 2, 64),  # Qwen2.5-0.5B
    "8B": (8_030_000_000, 32, 8, 128),  # Llama 3.1 8B
    "30B": (30_500_000_000, 48, 4, 128),  # Qwen3-30B-A3B
}
# Bytes a weight takes: float16; 4-bit with a float16 scale and bias per 64 (mlx-lm's).
BYTES_PER_PARAM = {"fp16": 2, "4bit": 4.5 / 8}


def mac(gb: int) -> DeviceMemory:
    """A Mac of `gb` GB: macOS recommends 2/3 of it as the GPU working set, 3/4 from 64 GB."""
    return DeviceMemory(gb * GIB, int(gb * GIB * (0.75 if gb >= 64 else 2 / 3)), True)


def model(name: str, context: int = 131072) -> ModelConfig:
    _, layers, kv_heads, head_dim = MODELS[name]
    return ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 1024,
        "intermediate_size": 1024, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": context,
    })  # fmt: skip


def plan(gb: int, name: str, weights: str = "fp16", kv_cache_dtype: str = "auto", **kw):
    cfg = model(name)
    kv = kv_footprint(cfg, mx.float16, kv_cache_dtype, 16, 64, 512)
    return plan_memory(mac(gb), int(MODELS[name][0] * BYTES_PER_PARAM[weights]), kv,
                       trained_context=cfg.trained_context_len, max_num_seqs=64, **kw)


@pytest.mark.parametrize(("gb", "name", "weights", "starts"), [
    (8, "0.5B", "fp16", True), (8, "0.5B", "4bit", True),
    (8, "8B", "fp16", False), (8, "8B", "4bit", False),  # 4.2 GiB leaves ~1k tokens
    (16, "8B", "fp16", False), (16, "8B", "4bit", True),
    (16, "30B", "4bit", False),
    (32, "8B", "fp16", True), (32, "30B", "fp16", False), (32, "30B", "4bit", True),
    (64, "8B", "fp16", True), (64, "30B", "fp16", False), (64, "30B", "4bit", True),
])  # fmt: skip
def test_which_models_start_on_which_macs(gb, name, weights, starts):
    if not starts:
        with pytest.raises(MemoryRefused):
            plan(gb, name, weights)
        return
    got = plan(gb, name, weights)
    machine = mac(gb)
    assert got.weights + got.headroom + got.budget <= machine.usable
    assert got.tokens >= 4096 and got.requests >= 1
    assert got.context == min(131072, got.tokens)


def test_weights_that_do_not_fit_ask_for_a_smaller_or_quantized_model():
    with pytest.raises(MemoryRefused) as refused:
        plan(16, "8B", "fp16")
    message = str(refused.value)
    assert "15.0 GiB of weights" in message and "10.7 GiB Metal recommended working set" in message
    assert "--quantize 4" in message and "--kv-cache-dtype" not in message


def test_a_kv_cache_too_small_names_the_flags_and_each_one_fits():
    with pytest.raises(MemoryRefused) as refused:
        plan(8, "8B", "4bit")
    message = str(refused.value)
    assert "not one request of 4096 tokens" in message and "128.0 KiB a token" in message
    assert "--kv-cache-dtype int8" in message and "smaller model" in message
    max_model_len = int(re.search(r"--max-model-len (\d+)", message).group(1))
    assert plan(8, "8B", "4bit", max_model_len=max_model_len).context == max_model_len


def test_an_explicit_kv_cache_memory_too_large_for_the_machine_is_refused():
    with pytest.raises(MemoryRefused) as refused:
        plan(16, "8B", "4bit", kv_cache_memory=8 * GIB)
    message = str(refused.value)
    assert "--kv-cache-memory 8.0 GiB does not fit" in message
    fits = int(re.search(r"--kv-cache-memory (\d+)MiB", message).group(1)) << 20
    assert plan(16, "8B", "4bit", kv_cache_memory=fits).budget == fits
    with pytest.raises(MemoryRefused):
        plan(16, "8B", "4bit", kv_cache_memory=fits + (1 << 20))


def test_an_explicit_kv_cache_memory_is_taken_as_given():
    got = plan(32, "8B", "4bit", kv_cache_memory=2 * GIB)
    assert got.budget == 2 * GIB and got.tokens == 2 * GIB // (128 << 10)
    assert got.origin == "--kv-cache-memory"


@pytest.mark.parametrize(("kv_cache_dtype", "ratio"), [("int8", 256 / 132), ("int4", 256 / 72)])
def test_quantized_kv_holds_2x_and_3_5x_the_tokens_of_float16(kv_cache_dtype, ratio):
    # head dim 128, per row: float16 256 bytes; int8 128 + 2 scales of 2 bytes, int4 64 + 4*2
    fp16 = plan(64, "8B", kv_cache_memory=4 * GIB)
    quantized = plan(64, "8B", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=4 * GIB)
    assert quantized.tokens / fp16.tokens == pytest.approx(ratio, rel=1e-3)
    assert quantized.tokens / fp16.tokens > {"int8": 1.9, "int4": 3.5}[kv_cache_dtype]


def test_quantized_kv_lets_a_refused_context_start():
    with pytest.raises(MemoryRefused):
        plan(32, "30B", "4bit", max_model_len=65536)
    assert plan(32, "30B", "4bit", kv_cache_dtype="int8", max_model_len=65536).requests == 1


def test_a_bad_kv_cache_dtype_names_the_choices():
    with pytest.raises(ValueError, match="int9.*auto, int8, int4"):
        kv_footprint(model("8B"), mx.float16, "int9", 16, 64, 512)


def test_headroom_is_a_tenth_of_the_usable_memory_and_at_least_1_gib():
    assert headroom_bytes(mac(8)) == GIB
    assert headroom_bytes(mac(64)) == int(48 * GIB * 0.1)


def test_the_default_budget_stops_at_what_the_running_requests_can_fill():
    got = plan(64, "0.5B", max_model_len=4096)
    assert got.tokens == 64 * 4096 and got.requests == 64
    assert got.budget == 64 * 4096 * (12 << 10)  # 24 layers x 2 heads x 64 x K,V x 2 bytes


def test_a_small_model_on_a_big_mac_takes_at_most_half_the_working_set():
    got = plan(64, "0.5B")
    assert got.budget == 24 * GIB and got.origin == "half the Metal recommended working set"
    assert plan(64, "0.5B", kv_cache_memory=40 * GIB).budget == 40 * GIB  # if asked


def test_off_a_mac_the_budget_stays_a_quarter_of_the_free_ram_and_at_most_4_gib():
    kv = kv_footprint(model("0.5B"), mx.float32, "auto", 16, 64, 256)
    host = DeviceMemory(64 * GIB, 32 * GIB, metal=False)
    assert plan_memory(host, GIB, kv, trained_context=131072, max_num_seqs=64).budget == 4 * GIB
    small = DeviceMemory(16 * GIB, 8 * GIB, metal=False)
    got = plan_memory(small, GIB, kv, trained_context=131072, max_num_seqs=64)
    assert got.budget == 2 * GIB and "a quarter" in got.origin


@pytest.mark.parametrize("cfg", [
    {"model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 64},
    {"model_type": "llama", "num_hidden_layers": 4},
])  # fmt: skip
def test_tokens_agree_with_the_engines_cache_plan(cfg):
    config = ModelConfig.from_dict({"vocab_size": 256, "hidden_size": 64,
                                    "intermediate_size": 128, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "head_dim": 16,
                                    "max_position_embeddings": 4096, **cfg})
    kv = kv_footprint(config, mx.float32, "auto", 16, 8, 256)
    got = plan_memory(mac(16), GIB, kv, trained_context=4096, max_num_seqs=8,
                      kv_cache_memory=64 << 20)
    engine = plan_cache(config, got.budget, mx.float32, 16, 8, 256, prefix_caching=True)
    assert got.tokens == engine.num_blocks * 16


def test_describe_names_budget_tokens_and_requests():
    lines = "\n".join(plan(32, "8B", "4bit", max_model_len=8192).describe())
    assert "32.0 GiB unified memory, 21.3 GiB Metal recommended working set" in lines
    assert "KV cache: float16, 128.0 KiB a token" in lines
    assert re.search(r"capacity: [\d,]+ tokens; \d+ concurrent requests at 8,192", lines)


def test_the_encoder_cache_is_a_line_of_its_own_and_no_kv_budget_takes_it():
    """Weights stay the weights; the encoder cache comes out of what the KV cache may take
    and counts in what the plan holds (and wires)."""
    text = plan(16, "8B", "4bit", max_model_len=8192)
    images = plan(16, "8B", "4bit", max_model_len=8192, encoder_cache=GIB)
    lines = images.describe()
    assert "encoder cache: 1.0 GiB" in lines[2] and lines[1] == text.describe()[1]
    assert not any("encoder" in line for line in text.describe())
    assert images.budget < text.budget and images.held == images.weights + GIB + images.budget
    spare = text.device.usable - text.weights - text.headroom
    with pytest.raises(MemoryRefused, match="does not fit"):
        plan(16, "8B", "4bit", kv_cache_memory=spare, encoder_cache=GIB)


def test_device_memory_on_a_simulated_mac(monkeypatch):
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {
        "memory_size": 16 * GIB, "max_recommended_working_set_size": 11453251584})
    assert device_memory() == DeviceMemory(16 * GIB, 11453251584, metal=True)


def test_device_memory_is_the_available_ram_or_on_a_mac_what_metal_says():
    got = device_memory()
    assert got.metal == mx.metal.is_available() and 0 < got.usable <= got.total
    if got.metal:  # a Mac: unified memory and Metal's recommended working set
        info = mx.device_info()
        assert (got.total, got.usable) == (info["memory_size"],
                                           info["max_recommended_working_set_size"])


def _record_limits(monkeypatch, previous_cache_limit: int) -> list:
    calls = []

    def set_cache(n):
        calls.append(("cache", n))
        return previous_cache_limit

    monkeypatch.setattr(mx, "set_cache_limit", set_cache)
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: calls.append(("wired", n)))
    return calls


def test_limits_on_a_mac_wire_weights_and_kv_and_cap_the_buffer_cache(monkeypatch):
    calls = _record_limits(monkeypatch, previous_cache_limit=100 * GIB)
    got = plan(16, "8B", "4bit")
    limits = apply_memory_limits(got)
    assert calls == [("cache", got.headroom // 2), ("wired", got.weights + got.budget)]
    assert limits.wired <= mac(16).usable


def test_limits_off_a_mac_never_raise_mlxs_own_cache_limit_nor_wire(monkeypatch):
    calls = _record_limits(monkeypatch, previous_cache_limit=32 << 20)
    kv = kv_footprint(model("0.5B"), mx.float32, "auto", 16, 64, 256)
    host = plan_memory(DeviceMemory(32 * GIB, 16 * GIB, metal=False), GIB, kv,
                       trained_context=4096, max_num_seqs=64)
    assert apply_memory_limits(host).cache == 32 << 20
    assert calls == [("cache", host.headroom // 2), ("cache", 32 << 20)]


def test_weight_bytes_of_a_model_dir_are_what_loading_it_takes(tiny_llama):
    from metal_engine.loading.weights import load_model, parameter_bytes

    _, path = tiny_llama
    config, weights = model_dir_weight_bytes(path, mx.float32)
    assert weights == parameter_bytes(load_model(path, mx.float32))
    assert config.num_hidden_layers == 2


def test_quantized_weights_kept_packed_count_their_stored_bytes(tiny_llama_with_tokenizer,
                                                                tmp_path, monkeypatch):
    from convert import convert_model
    from metal_engine.loading import weights as weights_module

    source = tiny_llama_with_tokenizer
    out = convert_model(source, tmp_path / "q4", quantize=4, group_size=32, progress=False)
    # As on a Mac, where quantized layers stay packed.
    monkeypatch.setattr(weights_module, "keeps_quantized", lambda: True)
    monkeypatch.setattr(weight_bytes, "keeps_quantized", lambda: True)
    loaded = weights_module.parameter_bytes(weights_module.load_model(out, mx.float16))
    assert model_dir_weight_bytes(out, mx.float16)[1] == loaded
    assert loaded < model_dir_weight_bytes(source, mx.float16)[1]


def test_off_a_mac_a_model_too_large_is_not_told_to_quantize():
    # The CPU backend dequantizes quantized checkpoints at load: they would take as much.
    kv = kv_footprint(model("8B"), mx.float32, "auto", 16, 64, 256)
    host = DeviceMemory(32 * GIB, 20 * GIB, metal=False)
    with pytest.raises(MemoryRefused, match="runs quantized weights as float32") as refused:
        plan_memory(host, 30 * GIB, kv, trained_context=131072, max_num_seqs=64)
    assert "--quantize" not in str(refused.value)
