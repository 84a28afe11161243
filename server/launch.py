"""Start the server from parsed `metal-serve serve` arguments."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

# First, before anything can import mlx.core: it picks the BLAS that mlx will use.
import metal_engine  # noqa: F401
from server.fleet.args import add_fleet_arguments, model_catalog
from server.http.logs import configure_logging
from server.serve_args import add_serve_arguments

__all__ = ["add_arguments", "serve"]

if TYPE_CHECKING:
    import mlx.core as mx

    from metal_engine.config import EngineConfig
    from metal_engine.loading.model_config import ModelConfig
    from server.app import HttpOptions

log = logging.getLogger("metal_serve")

# Third-party import-time advice that a server operator cannot act on, e.g. transformers'
# "PyTorch was not found" (the engine needs only its tokenizers). Our own warnings stay.
_QUIET_ENV = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`metal-serve serve`'s arguments: one model's, then those of a server of several."""
    add_serve_arguments(parser)
    add_fleet_arguments(parser.add_argument_group("several models (docs/several-models.md)"))


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted. Returns the process exit code."""
    configure_logging(args.log_level, args.log_format, args.log_prompts)
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)  # before anything imports transformers
    if args.dry_run:
        return _dry_run_all(args)
    if _is_other_rank(args):  # under mlx.launch: rank 0 serves, this one follows it
        from metal_engine.parallel.worker import run_rank

        return run_rank()
    try:
        options = _http_options(args)
        catalog = model_catalog(args)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"metal-serve: error: {exc}", file=sys.stderr)
        return 2
    if catalog is not None:
        from server.fleet.serve import serve_fleet

        return serve_fleet(args, catalog, options)
    return _serve_one(args, options)


def _dry_run_all(args: argparse.Namespace) -> int:
    """`dry_run` of the one model, or of each model of a server of several (each planned as if
    alone; loaded together they share --models-memory, see docs/several-models.md)."""
    from server.fleet.args import model_args

    try:
        catalog = model_catalog(args)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"metal-serve: error: {exc}", file=sys.stderr)
        return 2
    if catalog is None:
        return dry_run(args)
    codes = []
    for name, entry in catalog.entries.items():
        print(f"model {name!r}:")
        codes.append(dry_run(model_args(args, entry)))
    return max(codes)


def _serve_one(args: argparse.Namespace, options: HttpOptions) -> int:
    from metal_engine.cache.memory_plan import apply_memory_limits
    from server.model_loading import plan_model, resolve_model, start_model

    try:
        model_dir = resolve_model(args)
        config, plan = plan_model(model_dir, args)
        if plan is not None:
            apply_memory_limits(plan)  # before the weights load
        loaded = start_model(config, args)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"metal-serve: error: {exc}", file=sys.stderr)
        return 2

    from server.app import build_app
    from server.http.shutdown import run_server

    bridge, engine = loaded.bridge, loaded.bridge.engine
    app = build_app(bridge, args.served_model_name, args.max_n, options=options,
                    tool_call_parser=args.tool_call_parser, parameters=loaded.parameters)
    log.info(
        "serving %s (%s) as %r on http://%s:%d/v1", model_dir, loaded.parameters.describe(),
        args.served_model_name, args.host, args.port,
    )  # fmt: skip
    if (peers := engine.peers) is not None:
        peers.watch(bridge.report_fatal)
    run_server(app, args.host, args.port, args.log_level, args.shutdown_timeout,
               args.client_timeout, args.max_connections)
    return 1 if bridge.fatal is not None else 0


def _is_other_rank(args: argparse.Namespace) -> bool:
    from metal_engine.parallel.local_ranks import RANK_ENV, launched_by_mlx

    ranks = (args.tensor_parallel_size or 1) * (args.pipeline_parallel_size or 1)
    return ranks > 1 and launched_by_mlx() and os.environ[RANK_ENV] != "0"


def dry_run(args: argparse.Namespace) -> int:
    """`serve --dry-run`: print the memory plan of the model and flags `serve` was given,
    reading only config.json and tensor headers. 0 if it fits; 2 if refused or unreadable."""
    from metal_engine.cache.memory_plan import MemoryRefused, mac_capacities, plan_for
    from metal_engine.config import resolve_max_model_len
    from metal_engine.loading.model_dtype import resolve_dtype
    from metal_engine.loading.weight_bytes import drafter_weight_bytes
    from server.model_loading import engine_config

    try:
        path, model, weights_on = _planned_model(args)
        config = engine_config(path, args)
        weights = weights_on(None) + drafter_weight_bytes(
            config, resolve_dtype(config.dtype, config.model_dir))
        mac_dtype = resolve_dtype(config.dtype, config.model_dir, metal=True)
        mac_weights = weights_on(True) + drafter_weight_bytes(config, mac_dtype)
        label = path if args.model_dir is not None else f"the default model, {path}"
        print(f"memory plan for {label} ({model.model_type}):")
        plan = plan_for(config, model, weights)
        resolve_max_model_len(config, model.trained_context_len, plan.tokens)  # as serve does
        lines, refusal = plan.describe(), None
    except MemoryRefused as exc:
        lines, refusal = exc.facts, str(exc)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"metal-serve: error: {exc}", file=sys.stderr)
        return 2
    if config.tensor_parallel_size > 1:
        lines += _tensor_parallel_traffic(model, config)
    for line in lines:
        print(f"  {line}")
    if refusal is not None:
        print(f"does not fit: {refusal}")
    print(f"on a Mac ({str(mac_dtype).removeprefix('mlx.core.')}, macOS's default GPU working "
          "set):")
    for line in mac_capacities(config, model, mac_weights):
        print(f"  {line}")
    return 0 if refusal is None else 2


def _tensor_parallel_traffic(model: ModelConfig, config: EngineConfig) -> list[str]:
    from metal_engine.loading.model_dtype import resolve_dtype
    from metal_engine.parallel.traffic import step_traffic

    dtype_bytes = resolve_dtype(config.dtype, config.model_dir).size
    return [line for tokens in (1, 16) for line in
            step_traffic(model, config.tensor_parallel_size, tokens, dtype_bytes).describe()]


def _planned_model(args: argparse.Namespace
                   ) -> tuple[Path, ModelConfig, Callable[[bool | None], int]]:
    """What `serve` would load, without loading it (or converting it): the model dir or
    source, its config, and its weight bytes at the dtype it would run in on a Mac (True),
    off one (False) or on this machine (None), each read once."""
    from convert.api import open_source
    from convert.hub import is_repo_id
    from metal_engine.loading.model_dtype import resolve_dtype
    from metal_engine.loading.weight_bytes import model_dir_weight_bytes, weight_bytes

    reference = args.model_dir
    path = _default_model(args.cache_dir) if reference is None else Path(reference).expanduser()

    def dtype(metal: bool | None):
        return resolve_dtype("auto", path if path.is_dir() else None, metal=metal)

    if path.is_dir():
        model = model_dir_weight_bytes(path, dtype(None))[0]
        return path, model, lambda metal: model_dir_weight_bytes(path, dtype(metal))[1]
    if path.is_file():  # a .gguf: converted to float32, then loaded at `dtype`
        model = open_source(path).config
        return path, model, lambda metal: weight_bytes(model, dtype(metal))
    if is_repo_id(str(reference)):
        model, weights = _hub_model(str(reference), args.revision)
        return path, model, lambda metal: weights(dtype(metal))
    raise FileNotFoundError(f"model {reference} does not exist: pass a model dir, a .gguf "
                            "file or a hub repo id (org/name)")


def _default_model(cache_dir: Path | None) -> Path:
    """The default model's conversion if made (quick to read), else its GGUF (seconds)."""
    from convert.cache import is_current, models_dir
    from convert.default_model import MODEL_NAME, default_gguf_path

    gguf, converted = default_gguf_path(), models_dir(cache_dir) / MODEL_NAME
    return converted if is_current(converted, gguf) else gguf


def _hub_model(repo_id: str, revision: str | None
               ) -> tuple[ModelConfig, Callable[[mx.Dtype], int]]:
    """A hub repo's config and its weight bytes at a dtype, from its config.json and the
    safetensors headers the hub serves, without downloading the weights."""
    import json

    from huggingface_hub import get_safetensors_metadata, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, NotASafetensorsRepoError

    from metal_engine.loading.model_config import ModelConfig
    from metal_engine.loading.quantization import QuantizationConfig
    from metal_engine.loading.text_part import TEXT_PARTS
    from metal_engine.loading.weight_bytes import weight_bytes

    try:
        raw = json.loads(Path(hf_hub_download(repo_id, "config.json", revision=revision))
                         .read_text(encoding="utf-8"))
        model = ModelConfig.from_dict(raw)
        if QuantizationConfig.from_config(raw) is None:
            return model, lambda dtype: weight_bytes(model, dtype)
        files = get_safetensors_metadata(repo_id, revision=revision).files_metadata.values()
    except (EntryNotFoundError, NotASafetensorsRepoError) as exc:
        raise ValueError(f"{repo_id} is not a model metal-serve can serve: {exc}") from None
    tensors = {name: (info.dtype, tuple(info.shape))
               for file in files for name, info in file.tensors.items()}
    multimodal = raw.get("model_type") in TEXT_PARTS
    return model, lambda dtype: weight_bytes(model, dtype, tensors, multimodal)


def _http_options(args: argparse.Namespace) -> HttpOptions:
    from server.app import HttpOptions
    from server.http.host_check import allowed_hosts

    return HttpOptions(
        args.api_keys, args.allowed_origins, args.max_request_body,
        allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
        client_timeout_s=args.client_timeout, min_priority=args.min_request_priority,
        prefix_cache_scope=args.prefix_cache_scope,
    )  # fmt: skip
