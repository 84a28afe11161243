"""Rank 0's side of an engine over several ranks: it starts or joins the other ranks, sends
them the engine's settings and cache plan at startup, then each step's plan before its own
forward, so every rank runs the same step on its share of the model (`split`). Only rank 0
samples: with tensor parallelism the others' layers end in the same sums, with pipeline
parallelism the last rank hands rank 0 the final hidden states; either way every rank's KV
pools hold its part of the same blocks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from metal_engine.config import EngineConfig
from metal_engine.parallel.group import RankGroup, RankLost
from metal_engine.parallel.local_ranks import LocalRanks, launched_by_mlx
from metal_engine.parallel.split import ModelSplit
from scheduler.output import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMessage:
    """One step for the other ranks: the requests released since the last, then the step."""

    released: list[str]
    out: SchedulerOutput


class Peers:
    def __init__(self, group: RankGroup, local: LocalRanks | None, split: ModelSplit) -> None:
        self.group = group
        self.local = local
        self.split = split

    @classmethod
    def start(cls, config: EngineConfig) -> Peers:
        """Start ranks 1.. on this host (unless `mlx.launch` started them), meet them, and send
        them `config`."""
        size = config.parallel_size
        local = None if launched_by_mlx() else LocalRanks(size)
        try:
            group = RankGroup()
            if group.size != size:
                raise ValueError(f"{size} ranks asked for but {group.size} were launched: "
                                 "give mlx.launch as many hosts as ranks")
            group.broadcast(config)
        except BaseException:
            if local is not None:
                local.stop(timeout_s=0)
            raise
        split = ModelSplit.of(config, group)
        log.info("%s parallelism: rank 0 of %d%s", "pipeline" if split.by_layers else "tensor",
                 size, " (ranks on this host)" if local else "")
        return cls(group, local, split)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def one_host(self) -> bool:
        """Whether every rank runs on this machine (they share its memory)."""
        return self.local is not None

    def send(self, message: object) -> None:
        """Send a startup message (the cache plan) to the other ranks."""
        self.group.broadcast(message)

    def send_step(self, released: list[str], out: SchedulerOutput) -> None:
        self.group.broadcast(StepMessage(released, out))

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Report a rank on this host that exits while serving (across hosts, the next step
        finds out: its sums fail)."""
        if self.local is not None:
            self.local.watch(on_lost)

    def stop(self) -> None:
        """Tell the other ranks to exit, and wait for those on this host."""
        try:
            self.group.broadcast(None)
        except RankLost as exc:
            log.warning("could not stop every rank: %s", exc)
        if self.local is not None:
            self.local.stop()

    def abandon(self) -> None:
        """Startup failed on rank 0: end the ranks on this host now (across hosts, they see
        rank 0 go)."""
        if self.local is not None:
            self.local.stop(timeout_s=0)
