"""The CPU host backend: MLX's CPU backend with numpy and compiled host loops where MLX's CPU
ops are slow (kernels_metal.cpu.ops.HostOps is its ops; the rest are its loops)."""
