"""Model conversion: GGUF files, Hugging Face dirs and hub repos to MLX model dirs the engine
loads."""

# Every submodule is imported after this line, so the optimized BLAS loads before mlx does.
import metal_engine  # noqa: F401
from convert.api import convert_model
from convert.default_model import DefaultModelMissing, ensure_default_model
from convert.model_ref import resolve_model

__all__ = ["DefaultModelMissing", "convert_model", "ensure_default_model", "resolve_model"]
