"""How many parameters a model has, and how many of them each token runs through: all of a dense
model's, but of a mixture of experts only its `experts_per_token` of `num_experts` experts
(the router, attention, shared expert and embeddings are always active)."""

from __future__ import annotations

from dataclasses import dataclass

from mlx.utils import tree_flatten

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.moe import SwitchLinear
from metal_engine.models.registry import model_class


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int  # per token

    def describe(self) -> str:
        """E.g. "30.53B parameters, 3.35B active per token"; dense models say only the first."""
        text = f"{_short(self.total)} parameters"
        if self.active != self.total:
            text += f", {_short(self.active)} active per token"
        return text


def count_parameters(config: ModelConfig) -> ParameterCount:
    """The counts of a model of `config` (a tied head counted once), from the shapes of its
    parameters; nothing is allocated."""
    model = model_class(config.model_type)(config)
    experts = {path for path, module in model.named_modules() if isinstance(module, SwitchLinear)}
    total = active = 0
    for name, value in tree_flatten(model.parameters()):
        total += value.size
        if name.rpartition(".")[0] in experts:  # stacked [experts, ...]: k of them per token
            active += value.size // config.moe.num_experts * config.moe.experts_per_token
        else:
            active += value.size
    return ParameterCount(total, active)


def _short(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)
