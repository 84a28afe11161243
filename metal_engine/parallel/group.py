"""The ranks of an engine over MLX's distributed layer, and how rank 0 tells the
others what to do.

Rank 0 is the only rank that schedules: every message (the engine's settings at startup, then
each step's plan) goes from rank 0 to all ranks as one `all_sum`, the others adding zeros, so
no transport but `mx.distributed` is involved. Messages are pickled: they are plain data
(the scheduler's dataclasses) between processes one operator started, never from a client.
"""

from __future__ import annotations

import pickle
from typing import Any

import mlx.core as mx
import numpy as np

from kernels_metal.cpu.math import on_cpu

# A message's first collective carries its length and up to this many bytes; a longer one
# (a step with long prompt chunks) takes a second for the rest.
INLINE_BYTES = 4096
_HEADER = 8  # the length, little-endian


class RankLost(RuntimeError):
    """A rank stopped answering: the ranks cannot continue in step."""


class RankGroup:
    """This process's place among the ranks (`mx.distributed.init` with the ring backend:
    MLX_RANK and MLX_HOSTFILE in the environment say which rank and where the others are)."""

    def __init__(self) -> None:
        self.group = mx.distributed.init(backend="ring", strict=True)
        self.rank, self.size = self.group.rank(), self.group.size()
        # The CPU path reads its arrays through numpy, and MLX 0.32 never returns from such
        # a read of a sum whose peer is gone (mx.eval raises). Its forward evaluates as it
        # goes anyway, so evaluating each sum at once costs nothing.
        self.evaluates_sums = on_cpu()

    def all_sum(self, x: mx.array) -> mx.array:
        summed = mx.distributed.all_sum(x, group=self.group)
        if self.evaluates_sums:
            evaluate(summed)
        return summed

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0's `message`, on every rank (the others pass nothing)."""
        payload = pickle.dumps(message) if self.rank == 0 else b""
        first = np.zeros(_HEADER + INLINE_BYTES, np.uint8)
        if self.rank == 0:
            first[:_HEADER] = np.frombuffer(len(payload).to_bytes(_HEADER, "little"), np.uint8)
            inline = payload[:INLINE_BYTES]
            first[_HEADER:_HEADER + len(inline)] = np.frombuffer(inline, np.uint8)
        first = self._sum_bytes(first)
        length = int.from_bytes(first[:_HEADER].tobytes(), "little")
        data = first[_HEADER:_HEADER + min(length, INLINE_BYTES)].tobytes()
        if length > INLINE_BYTES:
            rest = np.zeros(length - INLINE_BYTES, np.uint8)
            if self.rank == 0:
                rest[:] = np.frombuffer(payload[INLINE_BYTES:], np.uint8)
            data += self._sum_bytes(rest).tobytes()
        return pickle.loads(data)

    def _sum_bytes(self, data: np.ndarray) -> np.ndarray:
        summed = mx.distributed.all_sum(mx.array(data), group=self.group)
        evaluate(summed)
        return np.asarray(summed)


def evaluate(x: mx.array, *more) -> mx.array:
    """Evaluate `x` (and `more`), which may wait on other ranks; returns `x`."""
    try:
        mx.eval(x, *more)
    except RuntimeError as exc:
        raise RankLost(f"a rank was lost: {exc}") from exc
    return x
