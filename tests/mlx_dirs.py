"""Model dirs in mlx-lm's layout, written by tests, and the check that two dirs hold the same
checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx


def save_mlx_dir(out: Path, source: Path, tensors: dict[str, mx.array],
                 quantization: dict) -> Path:
    """What mlx-lm's convert leaves in `out`: the tensors, `source`'s config with the
    quantization entries (twice, as mlx-lm writes them) and its tokenizer."""
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    config = json.loads((source / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True))
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")
    return out


def assert_same_checkpoint(theirs: Path, ours: Path) -> dict[str, mx.array]:
    """Same tensor names, dtypes and bits, and the same quantization entries; returns
    `theirs`' tensors."""
    their_tensors, our_tensors = (mx.load(str(d / "model.safetensors")) for d in (theirs, ours))
    assert set(our_tensors) == set(their_tensors)
    for name, tensor in their_tensors.items():
        assert our_tensors[name].dtype == tensor.dtype, name
        assert mx.array_equal(our_tensors[name], tensor), name
    their_config, our_config = (json.loads((d / "config.json").read_text())
                                for d in (theirs, ours))
    for key in ("quantization", "quantization_config"):
        assert our_config[key] == their_config[key], key
    return their_tensors
