"""`metal-serve bench graph`: what one step of the Metal code path launches and costs the host,
beside mlx-lm's model of the same config, traced on any machine (no GPU needed).

Per model and batch: kernels per layer (the layers' share of a step, averaged over one period
of layer kinds), kernels per step, host time to build a step's graph (runner included, device
work left out; CPU time of the thread that builds it), and host synchronizations per step
(graph_trace.py says how each is counted).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass

import metal_engine  # noqa: F401  # isort: skip  (loads the optimized BLAS before mlx)
import mlx.core as mx

from server.bench.graph_configs import CONFIGS, for_trace, layer_period, load_config
from server.bench.graph_steps import MlxLmStep, OurStep, StepShape, metal_path
from server.bench.graph_trace import SyncCounter, count_kernels, cpu_evaluable, metal_stand_ins


@dataclass(frozen=True)
class GraphRow:
    model: str
    batch: int
    mixed: bool
    layers: int
    kernels_per_layer: float
    mlx_lm_kernels_per_layer: float
    kernels_per_step: int
    mlx_lm_kernels_per_step: int
    build_ms: float
    mlx_lm_build_ms: float
    syncs_per_step: int
    mlx_lm_syncs_per_step: int
    layer_primitives: dict  # kernels per layer by primitive, ours
    mlx_lm_layer_primitives: dict


def add_graph_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"built-in configs ({', '.join(CONFIGS)}; default: all) or model "
                             "dirs / config.json files")
    parser.add_argument("--batch", default="1,16", help="decode batch sizes, comma-separated")
    parser.add_argument("--mixed", action="store_true",
                        help="also trace a step that mixes a prefill chunk with the decodes")
    parser.add_argument("--steps", type=int, default=20, help="timed builds of each step")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")


def run_graph(args: argparse.Namespace) -> int:
    rows = []
    with metal_stand_ins():
        for name in args.models or list(CONFIGS):
            config = load_config(name)
            for batch in (int(b) for b in args.batch.split(",")):
                for mixed in (False, True) if args.mixed else (False,):
                    row = trace(name, config, StepShape(batch, mixed), args.steps)
                    rows.append(row)
                    if args.json:
                        print(json.dumps(asdict(row)), flush=True)
    if not args.json:
        print(table(rows))
    return 0


def trace(name: str, config: dict, shape: StepShape, steps: int) -> GraphRow:
    period = layer_period(config)
    ours = [_counted(OurStep(for_trace(config, n), shape)) for n in (period, 2 * period)]
    theirs = [_counted(MlxLmStep(for_trace(config, n), shape)) for n in (period, 2 * period)]
    full_ours, full_theirs = OurStep(for_trace(config), shape), MlxLmStep(for_trace(config), shape)
    ours_step, theirs_step = _counted(full_ours), _counted(full_theirs)
    build_ms, theirs_ms = _timed(full_ours, full_theirs, steps)
    return GraphRow(
        model=name, batch=shape.batch, mixed=shape.mixed,
        layers=config["num_hidden_layers"],
        kernels_per_layer=(ours[1][0].kernels - ours[0][0].kernels) / period,
        mlx_lm_kernels_per_layer=(theirs[1][0].kernels - theirs[0][0].kernels) / period,
        kernels_per_step=ours_step[0].kernels, mlx_lm_kernels_per_step=theirs_step[0].kernels,
        build_ms=build_ms, mlx_lm_build_ms=theirs_ms,
        syncs_per_step=ours_step[1], mlx_lm_syncs_per_step=theirs_step[1],
        layer_primitives=_per_layer(ours, period), mlx_lm_layer_primitives=_per_layer(theirs,
                                                                                     period))


def _counted(step):
    """(kernels of the step's graph, host syncs while building it), after a warm-up step."""
    with _on_metal_path(step):
        # Run once for real, as serving does: weights packed, functions compiled, constants
        # that models build lazily (rope frequencies, ...) evaluated.
        with cpu_evaluable():
            mx.eval(_build(step, SyncCounter(), numpy=False))
        syncs = SyncCounter()
        count = count_kernels(*_build(step, syncs, numpy=True))
    return count, syncs.count


def _build(step, syncs: SyncCounter, numpy: bool) -> list[mx.array]:
    """The step's graph, built from the pools as they were before it."""
    step.reset()
    with syncs.active(numpy):
        return step.build()


def _on_metal_path(step):
    return metal_path(step.runner) if isinstance(step, OurStep) else contextlib.nullcontext()


def _timed(ours: OurStep, theirs: MlxLmStep, steps: int) -> tuple[float, float]:
    """Median ms to build each step, the two taking turns, each from a settled allocator.
    Counted in the building thread's CPU time: other processes on the machine then stretch
    neither."""
    times: dict[int, list[float]] = {0: [], 1: []}
    with metal_path(ours.runner):
        for _ in range(steps + 2):
            for i, step in enumerate((ours, theirs)):
                step.reset()
                gc.collect()
                _settle_allocator()
                with SyncCounter().active(numpy=False):
                    start = time.thread_time()
                    step.build()
                    times[i].append(time.thread_time() - start)
    return tuple(statistics.median(t[2:]) * 1e3 for t in (times[0], times[1]))


def _settle_allocator() -> None:
    """Merge what freeing the previous step's graph left in the C allocator, before the clock
    starts, for both sides alike. A graph's nodes free small chunks that glibc keeps in fast
    bins until the next allocation of 1 KB or more merges them all (~0.15 us a chunk, ~110
    chunks a layer on either side). Serving frees a graph while `mx.async_eval` encodes it;
    here the untimed reset frees it, and how decided which timed build paid for the merge:
    mlx-lm's caches, reset layer by layer among allocations, merged theirs in the reset; our
    pools, dropped at once, left 0.5-0.9 ms of merging to our build. A 64 KB allocation
    merges them (on other allocators it costs microseconds and changes nothing)."""
    bytearray(1 << 16)


def _per_layer(counts, period: int) -> dict[str, float]:
    more = Counter(counts[1][0].by_primitive)
    more.subtract(counts[0][0].by_primitive)
    return {k: v / period for k, v in sorted(more.items()) if v}


def table(rows: list[GraphRow]) -> str:
    lines = [
        "| model | batch | step | kernels / layer | mlx-lm | kernels / step | mlx-lm "
        "| build ms / step | mlx-lm | ratio | syncs / step | mlx-lm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} ({r.layers} layers) | {r.batch} | {'mixed' if r.mixed else 'decode'} "
            f"| {r.kernels_per_layer:g} | {r.mlx_lm_kernels_per_layer:g} "
            f"| {r.kernels_per_step} | {r.mlx_lm_kernels_per_step} "
            f"| {r.build_ms:.2f} | {r.mlx_lm_build_ms:.2f} | {r.build_ms / r.mlx_lm_build_ms:.2f} "
            f"| {r.syncs_per_step} | {r.mlx_lm_syncs_per_step} |")
    return "\n".join(lines)
