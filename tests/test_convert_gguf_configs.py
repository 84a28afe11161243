"""Every GGUF architecture the tests write converts to a dir transformers' AutoConfig loads
with the rope the engine reads (and, for GGUFs written from a Hugging Face checkpoint, the
rope transformers reads from that checkpoint). The Hugging Face families are checked in
test_convert_families.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_files import write_hybrid_gguf
from hf_configs import assert_transformers_reads_the_same_rope
from mxfp4_files import write_openai_mxfp4
from test_gguf_archs import ARCHS, write_arch_gguf
from test_gguf_gpt_oss import write_gpt_oss_gguf
from test_gguf_moe import GGUF_ARCHS, write_moe_gguf
from test_hybrid_checkpoints import GGUF_MODELS, build
from tiny_models import build_tiny_model

from convert import convert_model


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_arch_converts_to_a_dir_autoconfig_loads(arch: str, tmp_path: Path) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_arch_gguf(path, arch)
    out = convert_model(path, tmp_path / "out", progress=False)
    assert_transformers_reads_the_same_rope(out)


@pytest.mark.parametrize("model_type", list(GGUF_ARCHS))
def test_moe_gguf_converts_to_a_dir_autoconfig_loads(model_type: str, tmp_path: Path) -> None:
    build_tiny_model(model_type, tmp_path / "hf")
    path, _ = write_moe_gguf(model_type, tmp_path / "hf", tmp_path)
    out = convert_model(path, tmp_path / "out", progress=False)
    assert_transformers_reads_the_same_rope(out, tmp_path / "hf")


@pytest.mark.parametrize(("model_type", "overrides", "mtp_layers"), GGUF_MODELS)
def test_hybrid_gguf_converts_to_a_dir_autoconfig_loads(model_type, overrides, mtp_layers,
                                                       tmp_path: Path) -> None:
    build(model_type, tmp_path / "hf", **overrides)
    path = write_hybrid_gguf(tmp_path / "hf", tmp_path / "model.gguf", mtp_layers)
    out = convert_model(path, tmp_path / "out", progress=False)
    assert_transformers_reads_the_same_rope(out, tmp_path / "hf")


def test_gpt_oss_gguf_converts_to_a_dir_autoconfig_loads(tmp_path: Path) -> None:
    build_tiny_model("gpt_oss", tmp_path / "float")
    openai = write_openai_mxfp4(tmp_path / "float", tmp_path / "openai")
    path = write_gpt_oss_gguf(openai, tmp_path / "gpt-oss.gguf")
    out = convert_model(path, tmp_path / "out", progress=False)
    assert_transformers_reads_the_same_rope(out, openai)
