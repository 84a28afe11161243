"""What the host knows of one request that samples in a step: what the sampler, the
penalties and the rejection sampler read per row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler.sampling_params import SamplingParams


@dataclass(slots=True)  # not frozen: one is built per sampling row per step, on the hot path
class SamplingRow:
    """One request that samples this step, as the host knows it.

    The token histories are read only when the request has penalties. `allowed_tokens` is the
    grammar's bitmask (bit `t % 32` of int32 word `t // 32` set: token t allowed); None for a
    request without structure.
    """

    params: SamplingParams
    num_output_tokens: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    eos_token_ids: tuple[int, ...] = ()  # suppressed with stop_token_ids until min_tokens
    allowed_tokens: np.ndarray | None = None
