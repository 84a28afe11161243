"""Load one model to serve from parsed `serve` arguments: find it (converting it where it
needs to be), plan its memory, build its engine behind an AsyncEngine and warm it up.

A one-model server does this once before its port opens; a server of several models
(server.fleet) does it for each model when it is first asked for.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metal_engine.cache.memory_plan import DeviceMemory, MemoryPlan
    from metal_engine.config import EngineConfig
    from metal_engine.engine import LLMEngine
    from metal_engine.loading.parameter_count import ParameterCount
    from server.async_engine import AsyncEngine
    from server.media.options import MediaOptions
    from server.sampling_defaults import SamplingDefaults

log = logging.getLogger("metal_serve")

# EngineConfig field <- CLI option; options left unset keep the engine's defaults.
ENGINE_OPTIONS = (
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory", "block_size",
    "seed", "enable_prefix_caching", "scheduling_policy", "async_scheduling", "kv_cache_dir",
    "kv_cache_dir_size", "allow_long_max_model_len", "speculative_config", "kv_cache_dtype",
    "tensor_parallel_size", "pipeline_parallel_size", "kv_write_through", "dtype",
    "lora_modules", "max_loras", "max_lora_rank", "task", "encoder_cache_memory",
)  # fmt: skip


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: its engine's async front (warmed up, its thread started) and
    its parameter counts."""

    bridge: AsyncEngine
    parameters: ParameterCount


def resolve_model(args: argparse.Namespace) -> Path:
    """The model dir to load: the default model, or a model dir, .gguf file or hub repo id
    (converted into the cache on first use where it needs to be)."""
    import convert

    if args.model_dir is None:
        # Raises a RuntimeError naming the pip command when the model package is missing.
        return convert.ensure_default_model(args.cache_dir)
    return convert.resolve_model(str(args.model_dir), args.revision, args.cache_dir)


def model_name(args: argparse.Namespace, model_dir: Path) -> str:
    """What /v1/models calls the model: the reference as typed (a hub repo id, not its
    snapshot dir), else the model dir's name."""
    reference = args.model_dir
    if reference is not None and not Path(reference).expanduser().exists():
        return str(reference)
    return model_dir.name


def engine_config(model_dir: Path, args: argparse.Namespace) -> EngineConfig:
    from metal_engine.config import EngineConfig
    from metal_engine.drafting.auto import resolve_speculative

    options = {name: getattr(args, name) for name in ENGINE_OPTIONS}
    return resolve_speculative(EngineConfig(  # `auto`: the method this model drafts with
        model_dir=model_dir, model_name=model_name(args, model_dir),
        **{k: v for k, v in options.items() if v is not None},
    ))


def plan_model(model_dir: Path, args: argparse.Namespace, device: DeviceMemory | None = None,
               ) -> tuple[EngineConfig, MemoryPlan | None]:
    """The engine config `args` set up for `model_dir` and its memory plan on `device`
    (default: this machine, measured now), before the weights load: a model that does not fit
    is refused in seconds (`MemoryRefused`, naming the numbers), not after loading it."""
    from metal_engine.cache.memory_plan import plan_for
    from metal_engine.loading.model_dtype import resolve_dtype
    from metal_engine.loading.weight_bytes import drafter_weight_bytes, model_dir_weight_bytes

    if not model_dir.is_dir():
        raise ValueError(
            f"model directory {model_dir} does not exist; "
            "run `metal-serve convert` first or omit it to use the default model"
        )
    config = engine_config(model_dir, args)
    if not (config.model_dir / "config.json").is_file():
        return config, None  # not a model dir: loading it names what is missing
    dtype = resolve_dtype(config.dtype, config.model_dir)
    model, weights = model_dir_weight_bytes(config.model_dir, dtype)
    weights += drafter_weight_bytes(config, dtype)
    return config, plan_for(config, model, weights, device)


def start_model(config: EngineConfig, args: argparse.Namespace) -> LoadedModel:
    """Build the engine `config` describes, start its AsyncEngine and warm it up on the
    engine thread. Raises RuntimeError, ValueError or OSError naming what failed."""
    from metal_engine.engine_build import build_engine
    from metal_engine.loading.parameter_count import count_parameters
    from server.async_engine import AsyncEngine

    defaults = sampling_defaults(config.model_dir, args)
    engine = build_engine(config)
    bridge = AsyncEngine(engine, args.max_queued_requests, log_prompts=args.log_prompts,
                         sampling_defaults=defaults,
                         report_cached_tokens=args.report_cached_tokens,
                         media=_media_options(args), lora_paths=dict(args.lora_modules or ()))
    try:  # on the thread that steps: the CPU backend's loops run slower on any other
        bridge.run_on_engine_thread(lambda: warm_up(engine))
    except (RuntimeError, ValueError, OSError) as exc:
        bridge.shutdown()
        raise RuntimeError(f"warm-up failed: {exc}") from exc
    return LoadedModel(bridge, count_parameters(engine.runner.model.config))


def sampling_defaults(model_dir: Path, args: argparse.Namespace) -> SamplingDefaults:
    """What requests get for the sampling fields they leave unset; logged, since a model's
    generation_config.json can change answers a lot."""
    from server.sampling_defaults import (
        MAX_NEW_TOKENS,
        generation_config_path,
        load_sampling_defaults,
    )

    choice, override = args.generation_config, dict(args.override_generation_config)
    if args.default_max_tokens is not None:
        override[MAX_NEW_TOKENS] = args.default_max_tokens
    defaults = load_sampling_defaults(model_dir, choice, override)
    defaults = replace(defaults, max_tokens_limit=args.max_tokens_limit)
    path = generation_config_path(model_dir, choice)
    origin = str(path) if path is not None else "the neutral defaults"
    if override:
        origin += " under --override-generation-config / --default-max-tokens"
    log.info("sampling defaults for unset request fields: %s (from %s)", defaults.describe(),
             origin)
    return defaults


def warm_up(engine: LLMEngine) -> None:
    """Run the model's steps once (metal_engine/warm_up.py) and log what fell back; before
    the model serves, so its first request does not pay for the compiles."""
    from kernels_metal.fallbacks import all_fallbacks
    from metal_engine.warm_up import warm_up as run_warm_up

    if engine.pooling is not None:  # warm-up samples; a pooling model's requests pool
        log.info("warm-up: skipped for a model that serves %s", engine.pooling.task)
        return
    seconds = run_warm_up(engine)
    fallbacks = all_fallbacks()
    log.info("warm-up: kernels built and checked, compiled loops loaded, in %.1f s; kernel "
             "fallbacks: %s", seconds, len(fallbacks) or "none")
    for fallback in fallbacks:
        log.warning("kernel fallback: %s %s runs on the reference: %s", fallback.kernel,
                    fallback.variant, fallback.reason)


def _media_options(args: argparse.Namespace) -> MediaOptions:
    from server.media.options import MediaOptions

    return MediaOptions(
        args.allowed_media_domains, args.allow_media_urls, args.limit_mm_per_prompt,
        args.max_image_pixels, args.max_image_bytes, args.media_fetch_timeout,
    )  # fmt: skip
