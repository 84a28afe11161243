"""Engine settings, built once at the CLI/server edge and passed down."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from scheduler.config import SchedulingPolicy
from scheduler.spec_decode.config import SpeculativeConfig

DType = Literal["auto", "float32", "float16", "bfloat16"]
# What the server answers (`--task`): "auto" as the checkpoint says (see
# metal_engine.loading.pooling_config); "score" is "rerank" (both routes serve either).
Task = Literal["auto", "generate", "embed", "rerank", "score"]
TASKS: tuple[Task, ...] = ("auto", "generate", "embed", "rerank", "score")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """`kv_cache_memory` (bytes) and `max_model_len` default to what the machine and model allow.

    `dtype="auto"` runs float32 on the CPU backend (its half-precision matmuls are slow) and
    the checkpoint's half dtype on Apple GPUs (metal_engine.loading.model_dtype).
    `enable_prefix_caching` reuses the KV cache of prompt prefixes seen before.
    `scheduling_policy` is fcfs or priority (see SchedulerConfig).
    A `max_model_len` beyond the model's trained context is refused unless
    `allow_long_max_model_len` (see resolve_max_model_len).
    """

    model_dir: Path
    model_name: str | None = None  # what the API calls it; default: the model dir's name
    task: Task = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    # None: 512 on an Apple GPU, 256 on the CPU backend (see default_token_budget).
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    allow_long_max_model_len: bool = False
    kv_cache_memory: int | None = None
    # A model that reads images: bytes for the vision tower's outputs (None: the default,
    # metal_engine.vision.encoder_cache.ENCODER_CACHE_BYTES).
    encoder_cache_memory: int | None = None
    # The pool's storage (`--kv-cache-dtype`): "auto" the model's dtype, or int8 / int4
    # codes with float16 group scales (kernels_metal.kv_quant).
    kv_cache_dtype: str = "auto"
    dtype: DType = "auto"
    seed: int = 0
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    # None: on where the forward runs asynchronously (Metal); see LLMEngine.
    async_scheduling: bool | None = None
    # Opt-in second tier of the prefix cache: blocks evicted from the pool (and all cached
    # blocks at shutdown) are kept here, keyed by model identity, up to this many bytes.
    kv_cache_dir: Path | None = None
    kv_cache_dir_size: int = 8 << 30
    # Save each block there as soon as a step computes it (a prefill server's handoff).
    kv_write_through: bool = False
    # Speculative decoding (`--speculative-config`): drafts that each decode step verifies.
    speculative_config: SpeculativeConfig | None = None
    # Ranks that split every layer's heads and inner width, or the layers between them
    # (metal_engine.parallel); one of the two at a time.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # LoRA adapters (`--lora-modules name=path`) loaded at start, and room for this many at
    # once (`--max-loras`, 0: as many as given) of rank up to `--max-lora-rank`.
    lora_modules: tuple[tuple[str, Path], ...] = ()
    max_loras: int = 0
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.kv_cache_dir is not None:
            object.__setattr__(self, "kv_cache_dir", Path(self.kv_cache_dir))
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        for name in ("kv_cache_memory", "encoder_cache_memory"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_write_through and self.kv_cache_dir is None:
            raise ValueError("--kv-write-through saves blocks to --kv-cache-dir: give it one")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"--max-loras must be at least 0 and --max-lora-rank at least 1, "
                             f"got {self.max_loras} and {self.max_lora_rank}")
        if self.max_loras and len(self.lora_modules) > self.max_loras:
            raise ValueError(f"{len(self.lora_modules)} --lora-modules given but --max-loras "
                             f"is {self.max_loras}: raise it")
        if self.parallel_size > 1:
            self._check_parallel()
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}"
            )


    @property
    def serves_adapters(self) -> bool:
        return bool(self.lora_modules) or self.max_loras > 0

    @property
    def parallel_size(self) -> int:
        """How many ranks (processes) run each step."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def parallel_flag(self) -> str:
        """The option that asked for several ranks, e.g. "--tensor-parallel-size 2"."""
        if self.tensor_parallel_size > 1:
            return f"--tensor-parallel-size {self.tensor_parallel_size}"
        return f"--pipeline-parallel-size {self.pipeline_parallel_size}"

    def _check_parallel(self) -> None:
        """What several ranks do not combine with yet, refused by option."""
        spec = self.speculative_config
        refused = {
            "--pipeline-parallel-size": self.tensor_parallel_size > 1
            and self.pipeline_parallel_size > 1,
            "--async-scheduling": self.async_scheduling,
            "--kv-cache-dir": self.kv_cache_dir is not None,
            "--lora-modules / --max-loras": self.serves_adapters,
            f"--speculative-config method {spec.method if spec else ''} (ngram and suffix "
            "drafts do combine)": spec is not None and spec.method in ("draft_model", "mtp"),
        }
        for option, given in refused.items():
            if given:
                raise ValueError(f"{self.parallel_flag} does not combine with {option} yet: "
                                 "drop one of them")


# The least KV cache that serves: the context is capped by what the cache holds.
MIN_KV_CACHE_BLOCKS = 2


def check_kv_cache_blocks(num_blocks: int, budget: int) -> None:
    """A ValueError naming --kv-cache-memory if a cache of `budget` bytes (`num_blocks`
    blocks) is too small to serve; checked before the context is fitted to the cache, which
    would otherwise shrink the context to whatever little the cache holds."""
    if num_blocks < MIN_KV_CACHE_BLOCKS:
        raise ValueError(
            f"a KV cache of {budget} bytes holds {num_blocks} blocks, fewer than the "
            f"{MIN_KV_CACHE_BLOCKS} it takes to serve: raise --kv-cache-memory"
        )


def resolve_max_model_len(config: EngineConfig, trained: int, kv_tokens: int) -> int:
    """The context limit: `config.max_model_len`, else the model's `trained` context capped by
    the `kv_tokens` the KV cache holds. An explicit limit the cache cannot hold is refused, so
    that a request within the context always fits the cache.

    Past its trained context a model's positions are ones it never saw: it answers garbage
    rather than failing, so going there takes `allow_long_max_model_len`, and a warning.
    """
    wanted = config.max_model_len
    if wanted is None:
        return min(trained, kv_tokens)
    if wanted > trained and not config.allow_long_max_model_len:
        raise ValueError(
            f"--max-model-len {wanted} is more than the {trained} tokens this model was trained "
            "on (max_position_embeddings in its config.json); lower it, or pass "
            "--allow-long-max-model-len to serve that long a context anyway"
        )
    if wanted > kv_tokens:
        raise ValueError(
            f"--max-model-len {wanted} needs {wanted} tokens of KV cache but the cache holds "
            f"{kv_tokens}: lower --max-model-len or raise --kv-cache-memory"
        )
    if wanted > trained:
        log.warning(
            "max model len %d is beyond the model's trained context of %d tokens: "
            "outputs past %d tokens may be garbage", wanted, trained, trained,
        )  # fmt: skip
    return wanted


def default_token_budget(on_gpu: bool) -> int:
    """Most tokens one step computes when the user has not said.

    A CPU step is tens of times slower than an Apple GPU's, and every running stream waits for
    the whole step: on the CPU a 512-token prefill chunk took over a second, so its budget is
    halved to keep inter-token latency under a second while new prompts prefill.
    """
    return 512 if on_gpu else 256
