"""`metal-serve serve` with several models: how the fleet plans, loads and unloads each one,
and the server around them."""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from server.app import HttpOptions
from server.fleet.args import model_args
from server.fleet.catalog import ModelCatalog, ModelEntry
from server.fleet.fleet import ModelFleet, Planned
from server.fleet.front import ServedModel, build_fleet_app

log = logging.getLogger("metal_serve")


def serve_fleet(args: argparse.Namespace, catalog: ModelCatalog, options: HttpOptions) -> int:
    """Serve `catalog`'s models until interrupted; the process exit code."""
    from metal_engine.cache.memory_plan import size
    from server.http.shutdown import run_server

    if (args.tensor_parallel_size or 1) * (args.pipeline_parallel_size or 1) > 1:
        print("metal-serve: error: several models are served on one rank; serve a model "
              "split over ranks on its own", file=sys.stderr)
        return 2
    fleet = fleet_of(catalog, args, options)
    preload = tuple(name for name, entry in catalog.entries.items()
                    if entry.pinned or name == catalog.default)
    app = build_fleet_app(fleet, options, preload)
    log.info("serving %d models (%s) in %s on http://%s:%d/v1", len(catalog.entries),
             ", ".join(catalog.entries), size(fleet.memory_bytes), args.host, args.port)
    run_server(app, args.host, args.port, args.log_level, args.shutdown_timeout,
               args.client_timeout, args.max_connections)
    return 0


def fleet_of(catalog: ModelCatalog, args: argparse.Namespace,
             options: HttpOptions) -> ModelFleet[ServedModel]:
    """The fleet of `catalog`'s models, none loaded yet. Each model's memory is planned as if
    it were alone in what the models may take together (--models-memory, else the machine's
    usable memory less a headroom), then room is made for it."""
    from metal_engine.cache.memory_plan import (
        DeviceMemory,
        MemoryLimits,
        device_memory,
        headroom_bytes,
        set_memory_limits,
    )

    device = device_memory()
    headroom = headroom_bytes(device)
    budget = catalog.memory_bytes or max(device.usable - headroom, 0)
    within = DeviceMemory(device.total, budget + headroom, device.metal)
    set_memory_limits(MemoryLimits(headroom // 2, budget if device.metal else None))

    def plan(entry: ModelEntry) -> Planned:
        from server.model_loading import plan_model, resolve_model

        own = model_args(args, entry)
        config, memory = plan_model(resolve_model(own), own, within)
        return Planned(0 if memory is None else memory.held, (own, config))

    def load(entry: ModelEntry, planned: Planned) -> ServedModel:
        from server.app import model_app
        from server.model_loading import start_model

        own, config = planned.details
        loaded = start_model(config, own)
        app = model_app(loaded.bridge, entry.name, own.max_n, own.tool_call_parser,
                        loaded.parameters, min_priority=options.min_priority,
                        needs_key=bool(options.api_keys))
        return ServedModel(loaded.bridge, app, loaded.parameters)

    return ModelFleet(catalog, budget, plan, load, _unload)


def _unload(served: ServedModel) -> None:
    """Stop the model's engine (its thread closes it) and give its memory back."""
    import mlx.core as mx

    served.bridge.shutdown()
    del served
    gc.collect()
    mx.clear_cache()
