"""Conversions kept in the metal-serve cache dir: made on first use, reused while the source
is unchanged."""

from __future__ import annotations

import os
from pathlib import Path

from convert.api import convert_model
from convert.model_dir import CONVERTER_VERSION, read_manifest


def default_cache_dir() -> Path:
    """$METAL_SERVE_CACHE, else ~/.cache/metal-serve."""
    return Path(os.environ.get("METAL_SERVE_CACHE") or Path.home() / ".cache" / "metal-serve")


def models_dir(cache_dir: Path | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "models"


def ensure_converted(source: Path, out: Path, progress: bool = True) -> Path:
    """`out`, converted to float32 from the local `source` unless it already holds that."""
    if is_current(out, source):
        return out
    try:
        return convert_model(source, out, dtype="float32", force=out.exists(), progress=progress)
    except FileExistsError:
        # Another process converted it while this one did; its result is as good.
        if is_current(out, source):
            return out
        raise


def is_current(out: Path, source: Path) -> bool:
    """Whether `out` is a float32 conversion of this `source` by this converter (same path;
    same size for a file; a dir source is a hub snapshot, which never changes under its
    commit's path). An older converter's dir is made again: it may lack what serving reads."""
    manifest = read_manifest(out)
    if manifest is None or not (out / "config.json").is_file():
        return False
    if manifest.get("converter_version") != CONVERTER_VERSION:
        return False
    if manifest.get("dtype") != "float32" or manifest.get("quantization"):
        return False
    if manifest["source"]["path"] != str(source.resolve()):
        return False
    recorded = manifest["source"]["files"].get(source.name, {})
    return source.is_dir() or recorded.get("size") == source.stat().st_size
