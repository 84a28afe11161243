"""Paged-attention kernels: Metal sources, their pure-MLX references, and the dispatcher."""

# Loads the optimized BLAS before anything here imports mlx (see metal_engine/blas.py).
import metal_engine  # noqa: F401
