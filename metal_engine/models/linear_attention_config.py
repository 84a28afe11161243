"""Gated DeltaNet's shape, read from a Hugging Face config's `linear_*` fields (Qwen3.5,
Qwen3-Next); no MLX here, so ModelConfig can hold it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int = 4
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_key_heads})")
        if self.conv_kernel_size < 1:
            raise ValueError(f"linear_conv_kernel_dim must be >= 1, got {self.conv_kernel_size}")

    @classmethod
    def from_hf(cls, hf: dict) -> GatedDeltaNetConfig:
        """From a Hugging Face text config (qwen3_5 / qwen3_next `linear_*` fields)."""
        return cls(hidden_size=hf["hidden_size"], num_key_heads=hf["linear_num_key_heads"],
                   num_value_heads=hf["linear_num_value_heads"],
                   key_head_dim=hf["linear_key_head_dim"],
                   value_head_dim=hf["linear_value_head_dim"],
                   conv_kernel_size=hf.get("linear_conv_kernel_dim", 4),
                   rms_norm_eps=hf.get("rms_norm_eps", 1e-6))

    def to_hf(self) -> dict:
        return {"linear_num_key_heads": self.num_key_heads,
                "linear_num_value_heads": self.num_value_heads,
                "linear_key_head_dim": self.key_head_dim,
                "linear_value_head_dim": self.value_head_dim,
                "linear_conv_kernel_dim": self.conv_kernel_size}  # fmt: skip

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:  # q, k and v go through the conv together
        return 2 * self.key_dim + self.value_dim
