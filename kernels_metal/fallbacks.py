"""Every kernel family's fallbacks (kernels_metal.dispatch): what /metrics counts, the
dashboard lists and the startup log names."""

from __future__ import annotations

from kernels_metal import attention, gated_delta
from kernels_metal.dispatch import Fallback


def all_fallbacks() -> list[Fallback]:
    return attention._state.fallbacks() + gated_delta._state.fallbacks()
