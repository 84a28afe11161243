"""llama.cpp's gpt-oss GGUFs convert with their MXFP4 experts kept MXFP4 (MLX's layout): the
same tensors as the conversion of the Hugging Face MXFP4 checkpoint they came from, computing
what transformers computes from it.

The GGUF is written here from a tiny GPT-OSS MXFP4 checkpoint (tests/mxfp4_files.py) as
llama.cpp's converter writes one: its tensor names (sinks as `attn_sinks.weight`), gate and up
split (even, odd rows), each expert stack repacked to ggml MXFP4 blocks (the exponent byte,
then values 0-15 in the low nibbles and 16-31 in the high ones), and the metadata keys of its
`set_gguf_parameters`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf_files import add_decoder_metadata, copy_tokenizer_metadata, finish
from mxfp4_files import write_openai_mxfp4
from safetensors.numpy import load_file
from tiny_models import VOCAB, build_tiny_model

from convert import convert_model
from convert.validate import probe_ids, prompt_logits, validate_conversion
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.weights import load_model

GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attn_{g}.{kind}"
       for p, g in [("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")]
       for kind in ("weight", "bias")},
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
}


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hugging Face MXFP4 blocks (values in pairs a byte) as ggml MXFP4 rows `[..., blocks *
    17]`: per block the exponent, then value j in the low nibble and j + 16 in the high one of
    byte j."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    halves = codes[..., :16] | (codes[..., 16:] << 4)
    ggml = np.concatenate([scales[..., None], halves], axis=-1)
    return ggml.reshape(*ggml.shape[:-2], -1)


def gguf_tensors(openai: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, Q | None]]:
    """The tensors llama.cpp's converter writes: (array, raw ggml type or None for float)."""
    out: dict[str, tuple[np.ndarray, Q | None]] = {}
    for name, tensor in openai.items():
        if name in GLOBAL_NAMES:
            out[GLOBAL_NAMES[name]] = (tensor, None)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        prefix = f"blk.{layer}"
        if rest in LAYER_NAMES:
            out[f"{prefix}.{LAYER_NAMES[rest]}"] = (tensor, None)
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[f"{prefix}.ffn_gate_exps.bias"] = (tensor[:, 0::2], None)
            out[f"{prefix}.ffn_up_exps.bias"] = (tensor[:, 1::2], None)
        elif rest == "mlp.experts.down_proj_bias":
            out[f"{prefix}.ffn_down_exps.bias"] = (tensor, None)
        elif rest == "mlp.experts.gate_up_proj_blocks":
            scales = openai[name.replace("_blocks", "_scales")]
            for parity, proj in enumerate(("gate", "up")):
                raw = ggml_mxfp4(tensor[:, parity::2], scales[:, parity::2])
                out[f"{prefix}.ffn_{proj}_exps.weight"] = (raw, Q.MXFP4)
        elif rest == "mlp.experts.down_proj_blocks":
            raw = ggml_mxfp4(tensor, openai[name.replace("_blocks", "_scales")])
            out[f"{prefix}.ffn_down_exps.weight"] = (raw, Q.MXFP4)
        elif not rest.endswith("_scales"):
            raise AssertionError(f"unmapped tensor {name}")
    return out


def add_metadata(writer: GGUFWriter, cfg: dict) -> None:
    rope = cfg["rope_parameters"]
    add_decoder_metadata(writer, cfg, cfg["num_hidden_layers"])
    writer.add_expert_count(cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_expert_feed_forward_length(cfg["intermediate_size"])
    copy_tokenizer_metadata(writer, VOCAB)
    writer.add_token_scores([0.0] * VOCAB)


def write_gpt_oss_gguf(openai_dir: Path, path: Path) -> Path:
    cfg = json.loads((openai_dir / "config.json").read_text())
    writer = GGUFWriter(path, "gpt-oss")
    add_metadata(writer, cfg)
    tensors = gguf_tensors(load_file(openai_dir / "model.safetensors"))
    for name, (tensor, raw_dtype) in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(tensor), raw_dtype=raw_dtype)
    finish(writer)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    build_tiny_model("gpt_oss", root / "float")
    openai = write_openai_mxfp4(root / "float", root / "openai")
    return openai, write_gpt_oss_gguf(openai, root / "gpt-oss.gguf")


def test_gpt_oss_gguf_converts_to_what_its_hf_checkpoint_does(sources, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    openai, gguf_path = sources
    ours = convert_model(gguf_path, tmp_path / "from-gguf", progress=False)
    from_hf = convert_model(openai, tmp_path / "from-hf", progress=False)

    got, expected = (mx.load(str(d / "model.safetensors")) for d in (ours, from_hf))
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert mx.array_equal(got[name], tensor), name  # the experts bit for bit
    assert got["model.layers.0.mlp.experts.down_proj.weight"].dtype == mx.uint32
    config = json.loads((ours / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}

    ours_cfg = ModelConfig.from_dict(config)
    theirs = ModelConfig.from_dict(json.loads((from_hf / "config.json").read_text()))
    assert ours_cfg.moe == theirs.moe and ours_cfg.layer_types == theirs.layer_types
    # The GGUF's tokenizer (borrowed from the default model) names its own special tokens.
    assert dataclasses.replace(ours_cfg, bos_token_id=theirs.bos_token_id,
                               eos_token_ids=theirs.eos_token_ids) == theirs

    ids = probe_ids(VOCAB) * 5
    model = AutoModelForCausalLM.from_pretrained(openai, dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        expected_logits = model(torch.tensor([ids])).logits[0].numpy()
    got_logits = prompt_logits(load_model(ours, mx.float32), ids)
    np.testing.assert_allclose(got_logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert validate_conversion(gguf_path, ours).relative_error == 0.0
