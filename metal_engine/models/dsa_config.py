"""DeepSeek sparse attention's indexer shape (DeepSeek V3.2, GLM-5), read from a Hugging Face
config; no MLX here, so ModelConfig can hold it.

Beside its latent attention, an indexing layer scores every cached key for each query with a
small multi-head projection of its own and attends only to the `top_k` best (models/dsa.py).
Its key is one `head_dim` vector a token, kept after the token's latent row in the same pool
row. GLM-5 runs the indexer on some layers only: a "shared" layer reuses the choice of the
indexing layer before it and keeps no key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> transformers' defaults of the indexer keys a config.json may leave out.
_DEFAULTS = {
    "deepseek_v32": {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64},
    "glm_moe_dsa": {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32},
}
DSA = tuple(_DEFAULTS)


@dataclass(frozen=True)
class IndexerConfig:
    num_heads: int
    head_dim: int  # its first qk_rope_head_dim turn with the rope, the rest pass
    top_k: int  # keys each query attends to, at most
    rope_interleave: bool  # GLM-5's rope pairs (0, 1), (2, 3), ...; DeepSeek's turns halves
    shared_layers: tuple[int, ...] = ()  # layers reusing the previous indexing layer's choice

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"index {name} must be at least 1, got {getattr(self, name)}")
        if 0 in self.shared_layers:
            raise ValueError("layer 0 of a sparse-attention model must run its indexer: a shared "
                             "layer reuses the choice of an indexing layer before it")

    def indexes(self, layer: int) -> bool:
        """Whether layer `layer` runs its own indexer (and keeps its key per token)."""
        return layer not in self.shared_layers

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> IndexerConfig:
        model_type = hf["model_type"]
        cfg = {**_DEFAULTS[model_type], **hf}
        return cls(num_heads=cfg["index_n_heads"], head_dim=cfg["index_head_dim"],
                   top_k=cfg["index_topk"], rope_interleave=model_type == "glm_moe_dsa",
                   shared_layers=_shared_layers(cfg) if model_type == "glm_moe_dsa" else ())

    def to_hf(self, num_layers: int) -> dict[str, Any]:
        keys: dict[str, Any] = {"index_n_heads": self.num_heads,
                                "index_head_dim": self.head_dim, "index_topk": self.top_k}
        if self.rope_interleave:  # GLM-5's, whose layers are listed by kind
            keys["indexer_types"] = ["full" if self.indexes(i) else "shared"
                                     for i in range(num_layers)]
        return keys


def _shared_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """GLM-5's layers that reuse the choice before them, as transformers reads them:
    `indexer_types`, else `index_topk_pattern` ("F" full, "S" shared), else every
    `index_topk_freq`-th layer from `index_skip_topk_offset - 1` indexes."""
    kinds = cfg.get("indexer_types")
    pattern = cfg.get("index_topk_pattern")
    if kinds is None and pattern is not None:
        kinds = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(
            pattern, str) else list(pattern)
    if kinds is None:
        freq = max(cfg.get("index_topk_freq") or 1, 1)
        offset = cfg.get("index_skip_topk_offset", 2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(cfg["num_hidden_layers"])]
    unknown = set(kinds) - {"full", "shared"}
    if unknown or len(kinds) != cfg["num_hidden_layers"]:
        raise ValueError(f"indexer_types must list 'full' or 'shared' for each of the "
                         f"{cfg['num_hidden_layers']} layers, got {kinds}")
    return tuple(i for i, kind in enumerate(kinds) if kind == "shared")
