"""Model references as users type them, resolved offline: hub repo ids against a hub cache laid
out in tmp_path (HF_HUB_OFFLINE=1, so nothing can download), .gguf files converted into the
metal-serve cache on first use, and pickle-only checkpoints refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from test_gguf_archs import write_arch_gguf
from tiny_models import build_tiny_model

from convert import convert_model, resolve_model
from convert.cli import add_convert_arguments, run_convert
from metal_engine.loading.weights import load_model
from server.cli import main

MAIN_COMMIT, TAGGED_COMMIT = "a" * 40, "b" * 40


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch) -> Path:
    """An empty hub cache, with downloads switched off the way users switch them off."""
    from huggingface_hub import constants

    cache = (tmp_path / "hub").resolve()  # huggingface_hub answers with resolved paths
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub read both when first imported; the test's values must win.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def add_repo(cache: Path, repo_id: str, files_from: Path, commit: str = MAIN_COMMIT,
             refs: tuple[str, ...] = ("main",)) -> Path:
    """Lay out `files_from`'s files as the hub cache does: blobs, a snapshot of symlinks to them
    under the commit, and refs naming the commit. Returns the snapshot dir."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(f for f in files_from.iterdir() if f.is_file()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A tiny random Llama as transformers saves it, with a tokenizer.json."""
    path = tmp_path_factory.mktemp("tiny-hf")
    build_tiny_model("llama", path)
    return path


@pytest.fixture(scope="module")
def tiny_mlx_8bit(tiny_hf: Path, tmp_path_factory) -> Path:
    """The same model in MLX's 8-bit layout, as an mlx-community repo holds it."""
    return convert_model(tiny_hf, tmp_path_factory.mktemp("mlx") / "q8", quantize=8,
                         group_size=32, progress=False)


def test_mlx_community_repo_loads_as_it_is(hub_cache, tiny_mlx_8bit) -> None:
    snapshot = add_repo(hub_cache, "mlx-community/tiny-llama-8bit", tiny_mlx_8bit)
    resolved = resolve_model("mlx-community/tiny-llama-8bit")
    assert resolved == snapshot
    assert load_model(resolved, mx.float32).config.vocab_size == 128


def test_hf_repo_in_our_layout_loads_as_it_is(hub_cache, tiny_hf) -> None:
    snapshot = add_repo(hub_cache, "org/tiny-llama", tiny_hf)
    assert resolve_model("org/tiny-llama") == snapshot


def test_revision_picks_the_snapshot(hub_cache, tiny_hf, tiny_mlx_8bit) -> None:
    add_repo(hub_cache, "org/tiny-llama", tiny_hf)
    tagged = add_repo(hub_cache, "org/tiny-llama", tiny_mlx_8bit, TAGGED_COMMIT, refs=("v1",))
    assert resolve_model("org/tiny-llama", revision="v1") == tagged
    assert resolve_model("org/tiny-llama", revision=TAGGED_COMMIT) == tagged


def test_repo_missing_offline_says_why(hub_cache) -> None:
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_model("org/not-cached")


def test_pickle_only_repo_and_dir_are_refused(hub_cache, tiny_hf, tmp_path) -> None:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_hf / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    add_repo(hub_cache, "org/pickled", pickled)
    with pytest.raises(ValueError, match=r"pickle checkpoints \(\*\.bin/\*\.pt\)"):
        resolve_model("org/pickled")
    with pytest.raises(ValueError, match="pickle.*metal-serve convert"):
        load_model(pickled, mx.float32)


def test_gguf_converts_on_first_use_into_the_cache(tmp_path) -> None:
    gguf = tmp_path / "tiny-qwen3.gguf"
    write_arch_gguf(gguf, "qwen3")
    cache = tmp_path / "metal-serve"
    out = resolve_model(str(gguf), cache_dir=cache, progress=False)
    assert out == cache / "models" / "tiny-qwen3"
    created = json.loads((out / "metal_serve_manifest.json").read_text())["created"]
    assert resolve_model(str(gguf), cache_dir=cache) == out  # reused, not converted again
    assert json.loads((out / "metal_serve_manifest.json").read_text())["created"] == created


def _convert_args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_convert_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("options", "reference"), [
    ((), "transformers (float32)"),
    (("--quantize", "8", "--group-size", "32"), "the source in float32"),
])
def test_convert_cli_takes_a_repo_id_and_validates(hub_cache, tiny_hf, tmp_path, capsys,
                                                   options, reference) -> None:
    add_repo(hub_cache, "org/tiny-llama", tiny_hf, TAGGED_COMMIT, refs=("v1",))
    args = _convert_args("org/tiny-llama", "--revision", "v1", "--out", str(tmp_path / "out"),
                         "--no-progress", *options)
    assert run_convert(args) == 0
    printed = capsys.readouterr().out
    assert "parameters" in printed and f"logits vs {reference}" in printed
    assert printed.rstrip().endswith("ok")


def test_serve_resolves_a_repo_id_and_names_the_model_after_it(hub_cache, tiny_hf,
                                                                monkeypatch) -> None:
    from metal_engine import engine_build

    snapshot = add_repo(hub_cache, "org/tiny-llama", tiny_hf)
    seen = []

    def from_config(config):
        seen.append(config)
        raise ValueError("stop before serving")

    monkeypatch.setattr(engine_build, "build_engine", from_config)
    assert main(["serve", "org/tiny-llama", "--revision", "main"]) == 2
    assert seen[0].model_dir == snapshot and seen[0].model_name == "org/tiny-llama"
