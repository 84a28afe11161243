"""Shared fixtures: tiny random Llama and Qwen3.5 checkpoints and the default model."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import metal_engine  # noqa: F401  (loads the optimized BLAS before mlx)

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,  # GQA: 3 query heads per KV head
    head_dim=16,
    max_position_embeddings=512,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """Put the root logger back after each test: `serve`'s main configures it with a handler
    on the stderr of its moment, which is pytest's capture, closed once the test ends."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(torch model, saved model dir) of a tiny random Llama in float32."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory):
    """(torch model, converted model dir) of a tiny Qwen3.5: Gated DeltaNet layers beside
    full attention."""
    from tiny_models import build_tiny_model

    from convert import convert_model

    source = tmp_path_factory.mktemp("qwen3_5-hf")
    model = build_tiny_model("qwen3_5_text", source)
    return model, convert_model(source, tmp_path_factory.mktemp("qwen3_5") / "model",
                                progress=False)


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory):
    """(torch model, converted model dir) of a tiny DeepSeek V3: multi-head latent
    attention."""
    from tiny_models import build_tiny_model

    from convert import convert_model

    source = tmp_path_factory.mktemp("deepseek-hf")
    model = build_tiny_model("deepseek_v3", source)
    return model, convert_model(source, tmp_path_factory.mktemp("deepseek") / "model",
                                progress=False)


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model, converted once into the user's cache (as `metal-serve serve` does)."""
    from convert import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tiny_llama, default_tokenizer, tmp_path_factory):
    """The tiny model dir with a tokenizer, as `build_engine` loads it."""
    path = tmp_path_factory.mktemp("tiny-with-tokenizer")
    shutil.copytree(tiny_llama[1], path, dirs_exist_ok=True)
    default_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base_url(engine):
    """A real server for the module's `engine` fixture (each server test module defines one)."""
    from server_helpers import running_server

    with running_server(engine) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    """The official openai client on `base_url`."""
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
