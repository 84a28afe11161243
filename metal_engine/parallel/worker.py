"""A rank other than 0: load this rank's shard, then run every step rank 0 sends until it
says stop. `python -m metal_engine.parallel.worker` (started by rank 0 on one host, or by
`metal-serve serve` under `mlx.launch` on another machine)."""

from __future__ import annotations

import logging
import signal
import sys

# First, before anything can import mlx.core: it picks the BLAS that mlx will use.
import metal_engine  # noqa: F401
from metal_engine.cache.kv_cache import KVCache
from metal_engine.config import EngineConfig
from metal_engine.loading.model_dtype import resolve_dtype
from metal_engine.loading.weights import load_model
from metal_engine.parallel.group import RankGroup, RankLost
from metal_engine.parallel.split import ModelSplit
from metal_engine.runner import ModelRunner

log = logging.getLogger("metal_serve")


def run_rank() -> int:
    """Serve as this process's rank until rank 0 stops it; the exit code."""
    # Rank 0 drains on SIGTERM / Ctrl-C and then stops the others: a signal meant for the
    # whole server (a terminal's Ctrl-C reaches every process) must not cut a rank off first.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    group = RankGroup()
    try:
        config: EngineConfig = group.broadcast()
        runner = _load(group, config)
        log.info("rank %d of %d: serving %s", group.rank, group.size, config.model_dir)
        while (message := group.broadcast()) is not None:
            runner.release(message.released)
            runner.forward_step(message.out)
    except RankLost as exc:
        log.error("rank %d: %s; exiting", group.rank, exc)
        return 1
    log.info("rank %d: stopped by rank 0", group.rank)
    return 0


def _load(group: RankGroup, config: EngineConfig) -> ModelRunner:
    dtype = resolve_dtype(config.dtype, config.model_dir)
    split = ModelSplit.of(config, group)
    model = load_model(config.model_dir, dtype, shard=split.cut)
    plan, quant = group.broadcast()
    cache = KVCache.for_model(split.cache_config(model.config), plan, config.block_size, dtype,
                              quant, split.held_pools(model))
    return ModelRunner(model, cache, stage=split.stage(model, cache, dtype))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    sys.exit(run_rank())
