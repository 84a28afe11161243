"""How much memory the KV cache gets, decided once at startup, and MLX's limits to match.

    usable      on a Mac the GPU's recommended working set (macOS keeps the rest for itself
                and other apps); elsewhere the host RAM available now
    - weights   the model as it will sit in memory (float weights in the run dtype)
    - encoder cache  a model that reads images: its vision tower's outputs
                (`--encoder-cache-memory`, metal_engine.vision.encoder_cache)
    - headroom  max(1 GiB, 10% of usable): a step's activations, MLX's buffer cache, the
                process itself (Python, tokenizer)
    = spare     the most the KV cache may take

The default budget is the spare, but at most half the usable memory and no more than
`max_num_seqs` requests at the full context can fill (off a Mac also at most a quarter of
the available RAM and 4 GiB, as before). A `--kv-cache-memory` larger than the spare is
refused, as is a default budget that does not hold one request of `MIN_DEFAULT_CONTEXT`
tokens (or the trained context if shorter): the error names the numbers and the flags that
would fit. docs/memory.md has more.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from kernels_metal.kv_quant import kv_quant_of
from metal_engine.cache.cache_plan import group_bytes
from metal_engine.config import default_token_budget
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.model_dtype import resolve_dtype
from metal_engine.vision.image_model import encoder_cache_bytes

if TYPE_CHECKING:
    from metal_engine.config import EngineConfig

log = logging.getLogger(__name__)

MIN_HEADROOM = 1 << 30
HEADROOM_FRACTION = 0.10
# A default KV cache takes at most this share of the usable memory: a small model on a big
# Mac leaves the rest to other apps (--kv-cache-memory may take all the spare).
DEFAULT_KV_SHARE = 0.5
# A default budget must hold one request this long (or the trained context if shorter);
# fewer tokens serve only toy prompts, so the server refuses and says how to fit more.
MIN_DEFAULT_CONTEXT = 4096
# Off Apple Silicon the pool comes out of system RAM: take a modest share of what is free.
HOST_MEMORY_FRACTION = 0.25
HOST_MEMORY_CAP = 4 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """`total`: physical memory; `usable`: what the server may fill (see the module doc)."""

    total: int
    usable: int
    metal: bool

    def describe(self) -> str:
        """E.g. "16.0 GiB unified memory, 10.7 GiB Metal recommended working set"."""
        return f"{size(self.total)} {self.total_name}, {size(self.usable)} {self.usable_name}"

    @property
    def total_name(self) -> str:
        return "unified memory" if self.metal else "RAM"

    @property
    def usable_name(self) -> str:
        return "Metal recommended working set" if self.metal else "available RAM"


def device_memory(metal: bool | None = None) -> DeviceMemory:
    """This machine's memory: Metal's if `metal` (None: whether this machine has Metal),
    else the host's. Off a Mac `usable` is what is free now: measure it before the weights
    are loaded, or they count twice."""
    if metal is None:
        metal = mx.metal.is_available()
    if metal:
        info = mx.device_info()
        total = info["memory_size"]
        return DeviceMemory(total, info.get("max_recommended_working_set_size", total), True)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceMemory(total, _available_host_memory(), False)


def headroom_bytes(device: DeviceMemory) -> int:
    """What stays out of weights and KV: a step's activations (~0.1 GiB at the default
    512-token step of an 8B model), MLX's buffer cache and the process; the 10% grows it
    with the machine, whose larger models have larger activations."""
    return max(MIN_HEADROOM, int(device.usable * HEADROOM_FRACTION))


@dataclass(frozen=True)
class KVFootprint:
    """What the KV cache costs: `bytes_per_block` for the pools that hold every token of the
    context, plus `fixed_bytes` sized by requests, not tokens (a sliding-window group's
    blocks, recurrent states)."""

    kv_cache_dtype: str  # "auto", "int8" or "int4"
    dtype_name: str  # the pools' dtype under "auto"
    block_size: int
    bytes_per_block: int
    fixed_bytes: int = 0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    @property
    def storage(self) -> str:
        return self.dtype_name if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def tokens_in(self, budget: int) -> int:
        """Tokens a budget of `budget` bytes holds, in whole blocks."""
        return max(budget - self.fixed_bytes, 0) // self.bytes_per_block * self.block_size

    def bytes_for(self, tokens: int) -> int:
        """The budget that holds `tokens` tokens."""
        return -(-tokens // self.block_size) * self.bytes_per_block + self.fixed_bytes


def kv_footprint(cfg: ModelConfig, dtype: mx.Dtype, kv_cache_dtype: str, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int) -> KVFootprint:
    """`cfg`'s cache groups under `--kv-cache-dtype` (ValueError naming the choices if bad).
    Prefix-cache state checkpoints of hybrid models come out of the budget besides
    (cache_plan)."""
    groups = group_bytes(cfg, dtype, block_size, max_num_seqs, max_num_batched_tokens,
                         kv_quant_of(kv_cache_dtype))
    name = str(dtype).removeprefix("mlx.core.")
    return KVFootprint(kv_cache_dtype, name, block_size, groups.bytes_per_block,
                       groups.fixed_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    """The KV budget and what it holds: `tokens` in the full-context pools, `requests` of
    `context` tokens at once (at most max_num_seqs)."""

    device: DeviceMemory
    weights: int
    headroom: int
    kv: KVFootprint
    budget: int
    tokens: int
    context: int
    requests: int
    max_num_seqs: int
    origin: str  # what set the budget, e.g. "--kv-cache-memory"
    encoder_cache: int = 0  # bytes for a vision tower's outputs (0: the model reads no images)

    @property
    def held(self) -> int:
        """What the model holds at most: weights, encoder cache and KV budget."""
        return self.weights + self.encoder_cache + self.budget

    def describe(self) -> list[str]:
        """The plan as log lines (the startup log, `serve --dry-run`)."""
        return [
            *_facts(self.device, self.weights, self.headroom, self.kv, self.encoder_cache),
            f"KV budget: {size(self.budget)} ({self.origin})",
            f"capacity: {self.tokens:,} tokens; {self.requests} concurrent "
            f"request{'s' if self.requests != 1 else ''} at {self.context:,} tokens of "
            f"context (max_num_seqs {self.max_num_seqs})",
        ]


class MemoryRefused(ValueError):
    """plan_memory's refusal; `facts`: the plan's lines known before it (device, weights, KV)."""

    def __init__(self, message: str, facts: list[str]) -> None:
        super().__init__(message)
        self.facts = facts


def _facts(device: DeviceMemory, weights: int, headroom: int, kv: KVFootprint,
           encoder_cache: int = 0) -> list[str]:
    encoder = ([f"encoder cache: {size(encoder_cache)} (image features between the prompt "
                "chunks and requests that read them)"] if encoder_cache else [])
    return [f"device: {device.describe()}",
            f"weights: {size(weights)}; headroom: {size(headroom)}",
            *encoder,
            f"KV cache: {kv.storage}, {size(int(kv.bytes_per_token))} a token"]


def plan_memory(device: DeviceMemory, weights: int, kv: KVFootprint, *, trained_context: int,
                max_num_seqs: int, max_model_len: int | None = None,
                kv_cache_memory: int | None = None, encoder_cache: int = 0) -> MemoryPlan:
    """The KV budget for `weights` bytes of model (and `encoder_cache` bytes for its vision
    tower's outputs) on `device`, or a MemoryRefused (a ValueError) naming the numbers and
    the flags that would fit. Pure: the caller measures the device. The refusals count the
    encoder cache with the weights."""
    headroom = headroom_bytes(device)
    facts = _facts(device, weights, headroom, kv, encoder_cache)
    weights += encoder_cache  # what the KV budget cannot take either
    spare = device.usable - weights - headroom
    if kv_cache_memory is not None:
        if kv_cache_memory > spare:
            raise MemoryRefused(_too_large(device, weights, headroom, kv, kv_cache_memory),
                                facts)
        budget, origin = kv_cache_memory, "--kv-cache-memory"
    else:
        budget, origin = _default_budget(device, spare, kv, max_num_seqs,
                                         max_model_len or trained_context)
    tokens = kv.tokens_in(budget)
    needed = max_model_len or (
        0 if kv_cache_memory is not None else min(trained_context, MIN_DEFAULT_CONTEXT))
    if tokens < needed:
        raise MemoryRefused(_too_small(device, weights, headroom, kv, budget, tokens, needed,
                                       max_model_len, kv_cache_memory is not None), facts)
    context = max_model_len or min(trained_context, tokens)
    requests = min(max_num_seqs, tokens // context) if context else 0
    return MemoryPlan(device, weights - encoder_cache, headroom, kv, budget, tokens, context,
                      requests, max_num_seqs, origin, encoder_cache)


def _default_budget(device: DeviceMemory, spare: int, kv: KVFootprint, max_num_seqs: int,
                    full_context: int) -> tuple[int, str]:
    """The budget when --kv-cache-memory is not given, and which limit set it."""
    limits = [(max(spare, 0), "what is left after the weights and the headroom"),
              (int(device.usable * DEFAULT_KV_SHARE), f"half the {device.usable_name}"),
              (kv.bytes_for(max_num_seqs * full_context),
               f"what {max_num_seqs} requests of {full_context} tokens fill")]
    if not device.metal:  # the CPU backend is for development: leave the host its RAM
        limits.append((min(int(device.usable * HOST_MEMORY_FRACTION), HOST_MEMORY_CAP),
                       "off a Mac: a quarter of the available RAM, at most 4 GiB"))
    return min(limits)


def _left(device: DeviceMemory, weights: int, headroom: int) -> str:
    return (f"of the {size(device.usable)} {device.usable_name} ({size(device.total)} "
            f"{device.total_name}), {size(weights)} of weights and {size(headroom)} of "
            f"headroom leave {size(budget_cap(device, weights, headroom))} for the KV cache")


def budget_cap(device: DeviceMemory, weights: int, headroom: int) -> int:
    """The largest --kv-cache-memory this machine takes."""
    return max(device.usable - weights - headroom, 0)


def _smaller_model(device: DeviceMemory) -> str:
    if not device.metal:  # load_model dequantizes there: a quantized checkpoint saves nothing
        return "a smaller model (the CPU backend runs quantized weights as float32)"
    return ("a smaller model, or a quantized one (`metal-serve convert SRC --out DIR "
            "--quantize 4` takes ~0.28x the float16 bytes)")


def _fixes(device: DeviceMemory, kv: KVFootprint, room: int | None, tokens: int) -> str:
    """The flags that would fit: a --kv-cache-memory of `room` bytes (None: it would not
    help), a quantized pool, a context of `tokens`, a smaller model."""
    fixes = [] if room is None else [f"--kv-cache-memory {room >> 20}MiB"]
    fixes += {"auto": ["--kv-cache-dtype int8 (~2x the tokens) or int4 (~3.5x)"],
              "int8": ["--kv-cache-dtype int4 (~1.8x the tokens of int8)"]}.get(
        kv.kv_cache_dtype, [])
    if tokens >= 2 * kv.block_size:
        fixes.append(f"--max-model-len {tokens}")
    return "To fit: " + "; ".join([*fixes, _smaller_model(device)])


def _too_large(device: DeviceMemory, weights: int, headroom: int, kv: KVFootprint,
               requested: int) -> str:
    cap = budget_cap(device, weights, headroom)
    if cap == 0:
        return _weights_do_not_fit(device, weights, headroom)
    return (f"--kv-cache-memory {size(requested)} does not fit this machine: "
            f"{_left(device, weights, headroom)}. {_fixes(device, kv, cap, 0)}")


def _weights_do_not_fit(device: DeviceMemory, weights: int, headroom: int) -> str:
    over = weights + headroom - device.usable
    return (f"the model does not fit this machine: {size(weights)} of weights and "
            f"{size(headroom)} of headroom are {size(over)} more than the "
            f"{size(device.usable)} {device.usable_name} ({size(device.total)} "
            f"{device.total_name}), before any KV cache. To fit: {_smaller_model(device)}")


def _too_small(device: DeviceMemory, weights: int, headroom: int, kv: KVFootprint,
               budget: int, tokens: int, needed: int, max_model_len: int | None,
               requested: bool) -> str:
    wanted = (f"the {max_model_len} tokens --max-model-len asks for" if max_model_len
              else f"one request of {needed} tokens (the least a default budget serves)")
    cap = budget_cap(device, weights, headroom)
    if cap == 0:
        return _weights_do_not_fit(device, weights, headroom)
    source = "--kv-cache-memory" if requested else "the default KV budget"
    enough = -(-kv.bytes_for(needed) // (1 << 20)) << 20  # in whole MiB, rounded up
    fixes = _fixes(device, kv, enough if enough <= cap else None, tokens)
    return (f"{source} of {size(budget)} holds {tokens} tokens at "
            f"{size(int(kv.bytes_per_token))} a token ({kv.storage}), not {wanted}: "
            f"{_left(device, weights, headroom)}. {fixes}")


def size(n: int) -> str:
    """Bytes for people: GiB, MiB or KiB with one decimal; negative stays negative."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# Mac sizes `serve --dry-run` plans for besides this machine.
MAC_SIZES_GB = (32, 64, 128)


def mac_memory(gb: int) -> DeviceMemory:
    """A Mac of `gb` GB as macOS sets it up by default: the GPU's recommended working set is
    about two thirds of the memory up to 36 GB, three quarters above (a Mac reports its own:
    `device_memory`)."""
    total = gb << 30
    return DeviceMemory(total, int(total * (0.75 if gb > 36 else 2 / 3)), True)


def mac_capacities(config: EngineConfig, model: ModelConfig, weights: int) -> list[str]:
    """What `model` (`weights` bytes at a Mac's dtype) costs on a Mac: its KV bytes a token,
    then a line per size of `MAC_SIZES_GB` with the KV budget left there and what it holds,
    or why the model does not fit."""
    kv = _footprint(config, model, metal=True)
    lines = [f"KV cache: {kv.storage}, {size(int(kv.bytes_per_token))} a token"]
    for gb in MAC_SIZES_GB:
        device = mac_memory(gb)
        try:
            plan = plan_for(config, model, weights, device)
        except MemoryRefused as exc:
            spare = device.usable - weights - headroom_bytes(device)
            why = (f"{size(weights)} of weights and {size(headroom_bytes(device))} of headroom "
                   f"in {size(device.usable)} usable" if spare <= 0
                   else str(exc).split(". ")[0])
            lines.append(f"{gb} GB Mac: does not fit: {why}")
            continue
        lines.append(f"{gb} GB Mac: KV budget {size(plan.budget)}, {plan.tokens:,} tokens; "
                     f"{plan.requests} concurrent request{'s' if plan.requests != 1 else ''} "
                     f"at {plan.context:,} tokens")
    return lines


def plan_for(config: EngineConfig, model: ModelConfig, weights: int,
             device: DeviceMemory | None = None) -> MemoryPlan:
    """The plan for serving `model` (`weights` bytes) as `config` says, on `device` (default:
    this machine, measured now); its dtype and step budget are a Mac's if `device.metal`."""
    device = device or device_memory()
    kv = _footprint(config, model, device.metal)
    return plan_memory(device, weights, kv,
                       trained_context=model.trained_context_len,
                       max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                       kv_cache_memory=config.kv_cache_memory,
                       encoder_cache=encoder_cache_bytes(config))


def _footprint(config: EngineConfig, model: ModelConfig, metal: bool) -> KVFootprint:
    """`model`'s KV footprint as `config` sets it up, on a Mac (`metal`) or off one."""
    dtype = resolve_dtype(config.dtype, config.model_dir, metal=metal)
    token_budget = config.max_num_batched_tokens or default_token_budget(metal)
    return kv_footprint(model, dtype, config.kv_cache_dtype, config.block_size,
                        config.max_num_seqs, token_budget)


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# ---------------------------------------------------------------- MLX's limits


@dataclass(frozen=True)
class MemoryLimits:
    cache: int  # mx.set_cache_limit
    wired: int | None  # mx.set_wired_limit; None off a Mac


def memory_limits(plan: MemoryPlan) -> MemoryLimits:
    """MLX keeps freed buffers for reuse, by default up to its whole memory limit: under a
    varied load (every batch a new shape) that cache creeps up to GBs. Half the headroom caps
    it; the other half is a step's live activations and the process. Wiring weights and KV
    (at most the working set, which MLX refuses to exceed) keeps macOS from paging them out
    between requests, while activations stay pageable for other apps."""
    wired = min(plan.held, plan.device.usable) if plan.device.metal else None
    return MemoryLimits(plan.headroom // 2, wired)


def apply_memory_limits(plan: MemoryPlan) -> MemoryLimits:
    """Set MLX's buffer-cache limit (and on a Mac its wired limit) from `plan`; once, at
    server start, before the weights load. Returns the limits set."""
    return set_memory_limits(memory_limits(plan))


def set_memory_limits(limits: MemoryLimits) -> MemoryLimits:
    """Set `limits` (the buffer cache's no higher than MLX's own default); the limits set."""
    previous = mx.set_cache_limit(limits.cache)
    if previous < limits.cache:  # MLX's own default is lower (the CPU backend's): keep it
        mx.set_cache_limit(previous)
        limits = MemoryLimits(previous, limits.wired)
    if limits.wired is not None:
        mx.set_wired_limit(limits.wired)
    wired = f", wired limit {size(limits.wired)}" if limits.wired is not None else ""
    log.info("MLX buffer-cache limit %s%s", size(limits.cache), wired)
    return limits
