"""What tensor parallelism sends between ranks per step, from the model's shape alone.

Each layer ends its two halves (attention or Gated DeltaNet, then the MLP or experts) in a
sum over ranks of the step's rows, `[tokens, hidden]` in the model's dtype; the step's plan
goes out before them. MLX's ring all_sum sends `2 (N - 1) / N` of the array from each rank,
in `2 (N - 1)` hops, so a decode step is bound by the hops' latency long before bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from metal_engine.loading.model_config import ModelConfig


@dataclass(frozen=True)
class StepTraffic:
    ranks: int
    tokens: int
    sums: int  # all_sums per step, the plan's included
    bytes_per_rank: float  # sent by each rank per step
    hops: int  # sequential sends per step, each a network round's latency

    def describe(self) -> list[str]:
        return [f"tensor parallelism over {self.ranks} ranks, a step of {self.tokens} tokens: "
                f"{self.sums} sums, {self.bytes_per_rank / 2**20:.2f} MiB sent by each rank, "
                f"{self.hops} sequential hops"]


def step_traffic(cfg: ModelConfig, ranks: int, tokens: int, dtype_bytes: int,
                 plan_bytes: int = 4096) -> StepTraffic:
    """Per-step traffic of `ranks` ranks for a step of `tokens` rows (one per decoding
    request); `plan_bytes`: the step's plan (a decode step's fits the first 4 KiB)."""
    layer_sums = 2 * cfg.num_hidden_layers
    share = 2 * (ranks - 1) / ranks
    rows = tokens * cfg.hidden_size * dtype_bytes
    return StepTraffic(ranks, tokens, layer_sums + 1,
                       share * (layer_sums * rows + plan_bytes),
                       2 * (ranks - 1) * (layer_sums + 1))
