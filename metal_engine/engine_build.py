"""Building an engine from its config: the backend and dtype, the model and tokenizer, the
memory and cache plans, the cache and its disk tier, the drafters, the scheduler and the
runner, wired into an `LLMEngine` (engine.py runs it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from kernels_metal.backends import device_ops_name
from kernels_metal.kv_quant import KVQuant, kv_quant_of
from metal_engine.cache.cache_plan import CachePlan, plan_cache
from metal_engine.cache.kv_cache import KVCache, PoolShape
from metal_engine.cache.memory_plan import device_memory, plan_for
from metal_engine.cache.pool_bytes import bytes_per_block
from metal_engine.config import (
    EngineConfig,
    check_kv_cache_blocks,
    default_token_budget,
    resolve_max_model_len,
)
from metal_engine.drafting.auto import resolve_speculative
from metal_engine.drafting.draft_model import DraftModel, load_draft_model
from metal_engine.drafting.mtp import MtpDrafter, head_cache, load_mtp_head, with_draft_length
from metal_engine.engine import LLMEngine
from metal_engine.kv_disk.connector import KVDiskConnector, TierStore
from metal_engine.kv_disk.directory import KVDiskDir
from metal_engine.kv_disk.store import KVDiskStore, Layout, model_identity
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.model_dtype import resolve_dtype
from metal_engine.loading.pooling_config import read_pooling_config
from metal_engine.loading.tokenizer_loading import load_tokenizer
from metal_engine.loading.weights import load_model, parameter_bytes
from metal_engine.lora.adapter_files import load_adapter
from metal_engine.lora.slots import AdapterSlots
from metal_engine.models.decoder import CausalLM
from metal_engine.models.ops_user import use_ops
from metal_engine.parallel.peers import Peers
from metal_engine.runner import ModelRunner
from metal_engine.vision.encoder_cache import encoder_cache_rows
from metal_engine.vision.image_model import ImageModel, has_vision_tower, load_image_model
from scheduler import Scheduler, SchedulerConfig
from scheduler.config import KVKind
from scheduler.spec_decode.config import SpeculativeConfig

log = logging.getLogger(__name__)


def build_engine(config: EngineConfig) -> LLMEngine:
    """The engine `config` describes: on this process alone, or as rank 0 of several."""
    config = resolve_speculative(config)
    if config.parallel_size == 1:
        return _build(config, None)
    _refuse_images_over_ranks(config)  # before any rank starts
    peers = Peers.start(config)
    try:
        return _build(config, peers)
    except BaseException:
        peers.abandon()
        raise


def _build(config: EngineConfig, peers: Peers | None) -> LLMEngine:
    """`peers`: the other ranks, with a share of the model each (this process is rank 0)."""
    metal = device_ops_name() == "metal"  # the one backend decision: the rest follows it
    device = device_memory(metal)  # before loading: off a Mac, the weights take what is free
    dtype = resolve_dtype(config.dtype, config.model_dir, metal=metal)
    split = peers.split if peers is not None else None
    parts = _load(config, dtype, split)
    model, image_model, mc = parts.model, parts.image_model, parts.model.config
    held = mc if split is None else split.cache_config(mc)  # what this rank's cache holds
    memory = plan_for(config, mc, _weight_bytes(parts, peers), device)
    for line in memory.describe():
        log.info("memory plan: %s", line)
    token_budget = _token_budget(config.max_num_batched_tokens or default_token_budget(metal),
                                 image_model, mc)
    quant = kv_quant_of(config.kv_cache_dtype)
    # The cache the pool plan is for: this rank's, or the whole model's where the ranks
    # split it by layers or all share this machine.
    planned = mc if split is not None and (split.by_layers or peers.one_host) else held
    plan = _plan_pool(config, planned, memory.budget, dtype, token_budget, quant,
                      parts.drafter)
    check_kv_cache_blocks(plan.num_blocks, memory.budget)
    max_model_len = resolve_max_model_len(config, mc.trained_context_len,
                                          plan.num_blocks * config.block_size)
    _check_encoder_len(mc, max_model_len)
    if peers is not None:
        peers.send((plan, quant))
    cache = KVCache.for_model(held, plan, config.block_size, dtype, quant,
                              split.held_pools(model) if split else None)
    _log_plan(plan, cache.storage, config, max_model_len, mc.trained_context_len)
    connector = _kv_disk_connector(config, cache)
    scheduler = Scheduler(_scheduler_config(
        config, plan, token_budget, max_model_len, mc, image_model,
        _encoder_rows(image_model, mc, dtype, memory.encoder_cache)), connector)
    device_drafter = (_device_drafter(model, parts.drafter, plan, config, dtype)
                      if parts.drafter is not None else None)
    # Async by default on Metal, on one rank: with several, each step's plan carries its
    # tokens, so it waits.
    async_scheduling = (metal and peers is None if config.async_scheduling is None
                        else config.async_scheduling)
    stage = split.stage(model, cache, dtype) if split else None
    runner = ModelRunner(model, cache, device_drafter, peers, stage, image_model,
                         _adapters(model, config))
    engine = LLMEngine(runner, scheduler, parts.tokenizer,
                       config.model_name or config.model_dir.name, async_scheduling, connector)
    engine.pooling = read_pooling_config(config.model_dir, config.task, mc, model.has_head)
    return engine


@dataclass(frozen=True)
class _Loaded:
    """What a model directory loads into: the model (this rank's share), its image model,
    its tokenizer and the drafter `--speculative-config` names."""

    model: CausalLM
    image_model: ImageModel | None
    tokenizer: object
    drafter: CausalLM | nn.Module | None


def _load(config: EngineConfig, dtype: mx.Dtype, split) -> _Loaded:
    model = load_model(config.model_dir, dtype, shard=split.cut if split else None)
    image_model = load_image_model(config.model_dir, dtype)
    if image_model is not None:  # the tower computes on the text model's backend
        use_ops(image_model.tower, model.ops)
    tokenizer = load_tokenizer(config.model_dir)
    return _Loaded(model, image_model, tokenizer,
                   _load_drafter(config, model, tokenizer, dtype))


def _weight_bytes(parts: _Loaded, peers: Peers | None) -> int:
    """The bytes of weights the memory plan counts on this machine: every rank's where they
    share it."""
    weights = parameter_bytes(parts.model)
    if parts.drafter is not None:
        weights += parameter_bytes(parts.drafter)
    if parts.image_model is not None:  # its outputs' share is the plan's encoder cache
        weights += parameter_bytes(parts.image_model.tower)
    return weights * peers.size if peers is not None and peers.one_host else weights


def _scheduler_config(config: EngineConfig, plan: CachePlan, token_budget: int,
                      max_model_len: int, mc: ModelConfig, image_model: ImageModel | None,
                      encoder_cache_rows: int) -> SchedulerConfig:
    encoder = mc.encoder is not None
    return SchedulerConfig(
        num_blocks=plan.num_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=token_budget,
        max_model_len=max_model_len,
        # An encoder's K/V of a token depend on the tokens after it: no prefix to share.
        enable_prefix_caching=config.enable_prefix_caching and not encoder,
        kv_kind=mc.kv_kind,
        scheduling_policy=config.scheduling_policy,
        window=plan.window,
        num_window_blocks=plan.num_window_blocks,
        num_state_slots=plan.num_state_slots,
        speculative=_speculative(config),
        encoder_cache_rows=encoder_cache_rows,
        encoder_step_rows=token_budget,
        whole_images=image_model is not None and image_model.whole_images,
        whole_prompts=encoder,
    )


def _speculative(config: EngineConfig) -> SpeculativeConfig | None:
    """The resolved speculative config (an MTP head's draft length filled in), logged."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "mtp":
        spec = with_draft_length(spec)
    log.info("speculative decoding: %s, up to %d drafts a step%s", spec.method,
             spec.num_speculative_tokens,
             ", only where they pay (never_slower)" if spec.never_slower else "")
    return spec


def _check_encoder_len(mc: ModelConfig, max_model_len: int) -> None:
    if mc.encoder is not None and max_model_len > mc.trained_context_len:
        raise ValueError(f"max_model_len {max_model_len} is past the encoder's "
                         f"{mc.trained_context_len} learned positions: give at most that")


def _encoder_rows(image_model: ImageModel | None, mc: ModelConfig, dtype: mx.Dtype,
                  budget: int) -> int:
    """The embedding rows the memory plan's `budget` bytes for the tower's outputs hold (0:
    the model reads no images)."""
    if image_model is None:
        return 0
    rows = encoder_cache_rows(mc.hidden_size * dtype.size * image_model.feature_maps, budget)
    log.info("encoder cache: %d embedding rows in %.1f MiB", rows, budget / 2**20)
    return rows


def _token_budget(budget: int, image_model: ImageModel | None, mc: ModelConfig) -> int:
    """`budget`, raised to the longest span a step must hold whole: the model's largest image
    where a step holds each image whole (so that a chunk stretched to an image's end stays
    within what the pools are sized for), an encoder's longest prompt."""
    if mc.encoder is not None:
        largest, what = mc.trained_context_len, "an encoder's prompt"
    elif image_model is not None and image_model.whole_images:
        largest, what = image_model.max_image_tokens, "each image"
    else:
        return budget
    if budget < largest:
        log.info("token budget raised from %d to %d: a step holds %s whole", budget, largest,
                 what)
    return max(budget, largest)


def _adapters(model: CausalLM, config: EngineConfig) -> AdapterSlots | None:
    """Room for the configured LoRA adapters, those given at start loaded."""
    if not config.serves_adapters:
        return None
    names = {config.model_name or config.model_dir.name, config.model_dir.name}
    slots = AdapterSlots(model, config.max_loras or len(config.lora_modules),
                         config.max_lora_rank, sorted(names))
    for name, path in config.lora_modules:
        slots.load(load_adapter(name, path))
        log.info("LoRA adapter %s loaded from %s (rank %d)", name, path, slots.ranks[name])
    return slots


def _refuse_images_over_ranks(config: EngineConfig) -> None:
    """A ValueError naming the flag when the checkpoint reads images: the ranks past the
    first hold no tower and take no image rows yet."""
    if has_vision_tower(config.model_dir):
        raise ValueError(
            f"{config.parallel_flag}: {config.model_dir} reads images, which are not served "
            "over several ranks yet. Serve it on one rank, or convert it with `metal-serve "
            "convert SRC --out DIR --text-only` to serve its text model over ranks")


def _kv_disk_connector(config: EngineConfig, cache: KVCache) -> KVDiskConnector | None:
    """The disk tier of the prefix cache, if `--kv-cache-dir` asks for one: a store per cache
    kind (blocks, a sliding-window group's blocks, a hybrid model's state checkpoints), all
    under the directory's one size bound."""
    if config.kv_cache_dir is None:
        return None
    disk = KVDiskDir(config.kv_cache_dir, config.kv_cache_dir_size)
    stores = {kind: TierStore(_disk_store(config, disk, None if kind == cache.kind else kind,
                                          group.layout), group.read, group.write)
              for kind, group in cache.groups().items()}
    for kind, parts in stores.items():
        log.info("KV disk cache: %d %s (%.1f MiB) in %s", parts.store.num_blocks, kind,
                 parts.store.used_bytes / 2**20, parts.store.root)
    log.info("KV disk cache: %.1f of %.1f MiB used in %s (every model's files)",
             disk.used_bytes / 2**20, disk.max_bytes / 2**20, disk.root)
    return KVDiskConnector(stores, cache.kind, write_through=config.kv_write_through)


def _load_drafter(config: EngineConfig, model: CausalLM, tokenizer,
                  dtype: mx.Dtype) -> CausalLM | nn.Module | None:
    """The weights speculative decoding drafts with on the device: a draft model, or the
    model's MTP head; None for the host's methods (or none)."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("draft_model", "mtp"):
        return None
    if spec.method == "draft_model":
        return load_draft_model(Path(spec.model), dtype, model, tokenizer)
    return load_mtp_head(Path(spec.model or config.model_dir), model, dtype)


def _drafter_pool_shapes(drafter: CausalLM | nn.Module) -> list[PoolShape]:
    if isinstance(drafter, CausalLM):
        return drafter.config.kv_pool_shapes()
    return [drafter.pool_shape()]


def _drafter_kind(drafter: CausalLM | nn.Module, cfg: ModelConfig) -> KVKind:
    """The kind of the drafter's pools: a draft model's own, an MTP head's that of the model
    `cfg` (the head's layer is one of the model's)."""
    return drafter.config.kv_kind if isinstance(drafter, CausalLM) else cfg.kv_kind


def _device_drafter(model: CausalLM, drafter: CausalLM | nn.Module, plan: CachePlan,
                    config: EngineConfig, dtype: mx.Dtype) -> DraftModel | MtpDrafter:
    """The drafter with its K/V pools, one block per block of the model's pool."""
    shapes, kind = _drafter_pool_shapes(drafter), _drafter_kind(drafter, model.config)
    size = plan.num_blocks * _drafter_block_bytes(drafter, model.config, config, dtype) / 2**20
    if isinstance(drafter, CausalLM):
        log.info("draft model %s: %d layers, its K/V in %.1f MiB beside the pool's",
                 config.speculative_config.model, drafter.config.num_hidden_layers, size)
        return DraftModel(drafter, KVCache(shapes, plan.num_blocks, config.block_size, dtype,
                                           kind=kind))
    log.info("MTP head: its K/V in %.1f MiB beside the pool's", size)
    return MtpDrafter(model, drafter, head_cache(drafter, kind, plan.num_blocks,
                                                 config.block_size, dtype))


def _drafter_block_bytes(drafter: CausalLM | nn.Module, cfg: ModelConfig,
                         config: EngineConfig, dtype: mx.Dtype) -> int:
    """One block of the drafter's pools (of the model `cfg`)."""
    return bytes_per_block(_drafter_pool_shapes(drafter), config.block_size, dtype,
                           kind=_drafter_kind(drafter, cfg))


def _disk_store(config: EngineConfig, disk: KVDiskDir, kind: str | None,
                layout: Layout) -> KVDiskStore:
    """`kind`: a group's beside the anchor; None for the anchor's blocks."""
    return KVDiskStore(disk, model_identity(config.model_dir, layout, kind), layout)


def _plan_pool(config: EngineConfig, cfg: ModelConfig, budget: int, dtype: mx.Dtype,
               token_budget: int, quant: KVQuant | None,
               drafter: CausalLM | nn.Module | None) -> CachePlan:
    """The cache plan for `budget` bytes. A drafter on the device keeps its K/V (unquantized)
    beside each block: the budget then splits between the two by bytes per block."""
    def plan(size: int) -> CachePlan:
        return plan_cache(cfg, size, dtype, config.block_size, config.max_num_seqs,
                          token_budget, config.enable_prefix_caching, quant)

    if drafter is None:
        return plan(budget)
    block = plan(budget).bytes_per_block
    drafter_bytes = _drafter_block_bytes(drafter, cfg, config, dtype)
    return plan(int(budget * block / (block + drafter_bytes)))


def _log_plan(plan: CachePlan, storage: str, config: EngineConfig, max_model_len: int,
              trained: int) -> None:
    tokens = plan.num_blocks * config.block_size
    log.info("KV cache (%s): %d tokens (%d blocks of %d, %.1f MiB), %d concurrent requests at "
             "the context length %d tokens (trained: %d)", storage, tokens, plan.num_blocks,
             config.block_size, plan.num_blocks * plan.bytes_per_block / 2**20,
             min(config.max_num_seqs, tokens // max_model_len), max_model_len, trained)
    if plan.num_window_blocks:
        log.info("sliding-window layers (window %d): %d blocks of their own (%.1f MiB)",
                 plan.window, plan.num_window_blocks,
                 plan.num_window_blocks * plan.bytes_per_window_block / 2**20)
    if plan.num_state_slots:
        log.info("recurrent state: %d slots of %.1f MiB", plan.num_state_slots,
                 plan.bytes_per_state_slot / 2**20)
