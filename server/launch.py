"""Start the server from parsed `metal-serve serve` arguments."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# First, before anything can import mlx.core: it picks the BLAS that mlx will use.
import metal_engine  # noqa: F401
from server.http.logs import configure_logging
from server.serve_args import add_serve_arguments

__all__ = ["add_serve_arguments", "serve"]

if TYPE_CHECKING:
    from metal_engine.engine import LLMEngine
    from metal_engine.parameter_count import ParameterCount
    from server.app import HttpOptions
    from server.sampling_defaults import SamplingDefaults

log = logging.getLogger("metal_serve")

# EngineConfig field <- CLI option; options left unset keep the engine's defaults.
_ENGINE_OPTIONS = (
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory", "block_size",
    "seed", "enable_prefix_caching", "scheduling_policy", "async_scheduling", "kv_cache_dir",
    "kv_cache_dir_size", "allow_long_max_model_len", "speculative_config",
)  # fmt: skip
# Third-party import-time advice that a server operator cannot act on, e.g. transformers'
# "PyTorch was not found" (the engine needs only its tokenizers). Our own warnings stay.
_QUIET_ENV = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted. Returns the process exit code."""
    configure_logging(args.log_level, args.log_format, args.log_prompts)
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)  # before anything imports transformers
    try:
        options = _http_options(args)
        model_dir = _resolve_model(args)
        defaults = _sampling_defaults(model_dir, args)
        engine = _load_engine(model_dir, args)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"metal-serve: error: {exc}", file=sys.stderr)
        return 2

    from server.app import build_app
    from server.async_engine import AsyncEngine
    from server.http.shutdown import run_server

    bridge = AsyncEngine(engine, args.max_queued_requests, log_prompts=args.log_prompts,
                         sampling_defaults=defaults,
                         report_cached_tokens=args.report_cached_tokens)
    parameters = _parameter_count(engine)
    app = build_app(bridge, args.served_model_name, args.max_n, options=options,
                    tool_call_parser=args.tool_call_parser, parameters=parameters)
    log.info(
        "serving %s (%s) as %r on http://%s:%d/v1", model_dir, parameters.describe(),
        args.served_model_name, args.host, args.port,
    )  # fmt: skip
    run_server(app, args.host, args.port, args.log_level, args.shutdown_timeout,
               args.client_timeout)
    return 0


def _resolve_model(args: argparse.Namespace) -> Path:
    """The model dir to load: the default model, or a model dir, .gguf file or hub repo id
    (converted into the cache on first use where it needs to be)."""
    import convert

    if args.model_dir is None:
        # Raises a RuntimeError naming the pip command when the model package is missing.
        return convert.ensure_default_model(args.cache_dir)
    return convert.resolve_model(str(args.model_dir), args.revision, args.cache_dir)


def _sampling_defaults(model_dir: Path, args: argparse.Namespace) -> SamplingDefaults:
    """What requests get for the sampling fields they leave unset; logged, since a model's
    generation_config.json can change answers a lot."""
    from server.sampling_defaults import generation_config_path, load_sampling_defaults

    choice, override = args.generation_config, args.override_generation_config
    defaults = load_sampling_defaults(model_dir, choice, override)
    path = generation_config_path(model_dir, choice)
    origin = str(path) if path is not None else "the neutral defaults"
    if override:
        origin += " under --override-generation-config"
    log.info("sampling defaults for unset request fields: %s (from %s)", defaults.describe(),
             origin)
    return defaults


def _model_name(args: argparse.Namespace, model_dir: Path) -> str:
    """What /v1/models calls the model: the reference as typed (a hub repo id, not its
    snapshot dir), else the model dir's name."""
    reference = args.model_dir
    if reference is not None and not Path(reference).expanduser().exists():
        return str(reference)
    return model_dir.name


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
        model_dir=model_dir, model_name=_model_name(args, model_dir),
        **{k: v for k, v in options.items() if v is not None},
    )
    return LLMEngine.from_config(config)


def _parameter_count(engine: LLMEngine) -> ParameterCount:
    """Total and per-token parameters, for the startup log and the model cards."""
    from metal_engine.parameter_count import count_parameters

    return count_parameters(engine.runner.model.config)


def _http_options(args: argparse.Namespace) -> HttpOptions:
    from server.app import HttpOptions
    from server.http.host_check import allowed_hosts

    return HttpOptions(
        args.api_keys, args.allowed_origins, args.max_request_body,
        allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
        client_timeout_s=args.client_timeout, min_priority=args.min_request_priority,
        prefix_cache_scope=args.prefix_cache_scope,
    )  # fmt: skip
