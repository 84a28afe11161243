"""Multi-head latent attention's shape (DeepSeek V2/V3, Kimi K2, GLM-4.7-Flash), read from a
Hugging Face config; no MLX here, so ModelConfig can hold it.

Each token's keys and values are kept as one compressed latent of `kv_lora_rank` values plus
one rope key of `qk_rope_head_dim` shared by every head: the width of a token's row in the
latent pool. A head's key is its `qk_nope_head_dim` up-projection of the latent then the rope
key; its value, a `v_head_dim` up-projection of the latent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MlaConfig:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: queries straight from the hidden state
    rope_interleave: bool = True  # the rope dims pair up as (0, 1), (2, 3), ...

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @classmethod
    def from_hf(cls, hf: dict) -> MlaConfig:
        return cls(kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                   qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                   q_lora_rank=hf.get("q_lora_rank"),
                   rope_interleave=bool(hf.get("rope_interleave", True)))

    def to_hf(self) -> dict:
        return {"kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
                "q_lora_rank": self.q_lora_rank, "rope_interleave": self.rope_interleave}

    @property
    def latent_width(self) -> int:
        """Values a token keeps per layer: its latent, then its rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim
