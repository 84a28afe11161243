"""The engine: model definitions, weights, paged KV pool, model runner, sampler, engine loop."""

from metal_engine.blas import load_optimized_blas

# Must run before anything imports mlx.core (see blas.py).
load_optimized_blas()
