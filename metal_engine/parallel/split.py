"""How a rank's share of the model is cut, the same way on every rank: by heads and inner
width (tensor parallelism: `shard`) or by layers (pipeline parallelism: `pipeline`)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from metal_engine.cache.kv_cache import KVCache
from metal_engine.config import EngineConfig
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.parallel.group import RankGroup
from metal_engine.parallel.pipeline import PipelineStage, keep_stage, stage_pools
from metal_engine.parallel.shard import RankShare, rank_config, shard_model


@dataclass(frozen=True)
class ModelSplit:
    group: RankGroup
    by_layers: bool  # pipeline parallelism; else tensor parallelism

    @classmethod
    def of(cls, config: EngineConfig, group: RankGroup) -> ModelSplit:
        return cls(group, config.pipeline_parallel_size > 1)

    @property
    def part(self) -> RankShare:
        return RankShare(self.group.rank, self.group.size, self.group.all_sum)

    def cut(self, model: CausalLM) -> None:
        """Keep this rank's share of `model`'s weights (load_model's `shard`)."""
        if self.by_layers:
            keep_stage(model, self.group.rank, self.group.size)
        else:
            shard_model(model, self.part)

    def cache_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config whose pools and state slots this rank holds."""
        return cfg if self.by_layers else rank_config(cfg, self.part)

    def held_pools(self, model: CausalLM) -> set[int] | None:
        """The KV pools that get blocks on this rank (None: all of them)."""
        if not self.by_layers:
            return None
        return stage_pools(model, self.group.rank, self.group.size)

    def stage(self, model: CausalLM, cache: KVCache, dtype: mx.Dtype) -> PipelineStage | None:
        return PipelineStage(model, cache, self.group, dtype) if self.by_layers else None
