"""Start the server from parsed `metal-serve serve` arguments."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# First, before anything can import mlx.core: it picks the BLAS that mlx will use.
import metal_engine  # noqa: F401
from server.serve_args import add_serve_arguments

__all__ = ["add_serve_arguments", "serve"]

if TYPE_CHECKING:
    from metal_engine.engine import LLMEngine

log = logging.getLogger("metal_serve")

# EngineConfig field <- CLI option; options left unset keep the engine's defaults.
_ENGINE_OPTIONS = (
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory", "block_size",
    "seed", "enable_prefix_caching", "scheduling_policy", "async_scheduling", "kv_cache_dir",
    "kv_cache_dir_size",
)  # fmt: skip


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted. Returns the process exit code."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        model_dir = args.model_dir or _default_model(args.cache_dir)
        engine = _load_engine(model_dir, args)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"metal-serve: error: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from server.app import build_app
    from server.async_engine import AsyncEngine

    app = build_app(AsyncEngine(engine), args.served_model_name, args.max_n)
    log.info(
        "serving %s as %r on http://%s:%d/v1", model_dir, args.served_model_name,
        args.host, args.port,
    )  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _default_model(cache_dir: Path | None) -> Path:
    # Raises a RuntimeError naming the pip command when the model package is missing.
    from convert import ensure_default_model

    return ensure_default_model(cache_dir)


def _load_engine(model_dir: Path, args: argparse.Namespace) -> LLMEngine:
    from metal_engine.config import EngineConfig
    from metal_engine.engine import LLMEngine

    if not model_dir.is_dir():
        raise ValueError(
            f"model directory {model_dir} does not exist; "
            "run `metal-serve convert` first or omit it to use the default model"
        )
    options = {name: getattr(args, name) for name in _ENGINE_OPTIONS}
    config = EngineConfig(
        model_dir=model_dir, **{k: v for k, v in options.items() if v is not None}
    )
    return LLMEngine.from_config(config)
