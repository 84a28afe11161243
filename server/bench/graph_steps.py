"""One step of a model, built again and again without running: metal-serve's through its
model runner on the Metal code path, and mlx-lm's model of the same config as its generate
loop builds it.

Both decode `batch` requests of `context` tokens each; with `mixed`, one of them is instead a
`chunk`-row prefill chunk (mlx-lm cannot put a chunk and decodes in one forward: its step is
then the chunk's forward plus the other requests' decode forward). K/V pools and caches are
zero-stride arrays of their full size, made again before each step: a trace never evaluates
them, and a scatter into an array (`pool[i] = x`) turns that very array into its output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx

from kernels_metal.attention import use_kernels
from kernels_metal.gated_delta import GatedDeltaKernel, use_kernel
from kernels_metal.paged import PagedAttentionKernels
from metal_engine.cache.cache_plan import CachePlan, window_blocks
from metal_engine.cache.kv_cache import KVCache
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.registry import model_class
from metal_engine.runner import ModelRunner
from scheduler import SamplingParams
from scheduler.output import ScheduledRequest, SchedulerOutput
from server.bench.graph_trace import StandInKernel, gpu_default_device

BLOCK_SIZE = 16
DTYPE = mx.float16  # what the Metal path serves by default
MLX_LM_TYPES = {"qwen3_5_text": "qwen3_5"}  # metal-serve's model_type -> mlx-lm's module


@dataclass(frozen=True)
class StepShape:
    batch: int
    mixed: bool = False
    context: int = 500  # tokens each request has before the step (no split-K under 512)
    chunk: int = 256  # rows of the prefill chunk of a mixed step


def zeros_like_leaf(shape, dtype) -> mx.array:
    """An evaluated array of `shape` that holds one element."""
    leaf = mx.broadcast_to(mx.zeros((), dtype), tuple(shape))
    mx.eval(leaf)
    return leaf


@contextlib.contextmanager
def metal_path(runner: ModelRunner) -> Iterator[None]:
    """The runner's model on the Metal code path, its kernels as stand-ins."""
    runner.model.use_ops("metal")
    with use_kernels(PagedAttentionKernels(StandInKernel)), use_kernel(
            GatedDeltaKernel(StandInKernel)):
        yield


class OurStep:
    """metal-serve's step: `ModelRunner.launch` of a SchedulerOutput."""

    def __init__(self, config: dict, shape: StepShape) -> None:
        cfg = ModelConfig.from_dict(config)
        model = model_class(cfg.model_type)(cfg)
        model.set_dtype(DTYPE)
        mx.eval(model.parameters())
        blocks_per_request = -(-(shape.context + shape.chunk) // BLOCK_SIZE)
        num_blocks = shape.batch * blocks_per_request + 1
        self.cache = _cache(cfg, shape.batch, num_blocks)
        self.runner = ModelRunner(model, self.cache)
        self.out = _scheduler_output(cfg, shape, blocks_per_request)

    def build(self) -> list[mx.array]:
        """The step's graph: sampled ids (and their logprob arrays) and every pool written."""
        launched = self.runner.launch(self.out)
        launched.sampled()  # the engine reads the step's tokens
        return [*launched.arrays(), *self.cache.arrays()]

    def reset(self) -> None:
        """Pools as before the step (its writes dropped)."""
        cache = self.cache
        cache.k, cache.v = ([_fresh(a) for a in pools] for pools in (cache.k, cache.v))
        if cache.states is not None:
            states = cache.states
            states.conv, states.recurrent = ([_fresh(a) for a in arrays]
                                             for arrays in (states.conv, states.recurrent))


def _fresh(a: mx.array | None) -> mx.array | None:
    return None if a is None else zeros_like_leaf(a.shape, a.dtype)


def _cache(cfg: ModelConfig, batch: int, num_blocks: int) -> KVCache:
    """Pools and state slots for the step, as zero-stride arrays of their full size."""
    plan = CachePlan(1, 0, num_state_slots=batch if cfg.linear_attention else 0)
    window = cfg.sliding_window
    if cfg.windowed_pools():
        plan = CachePlan(1, 0, windowed_pools=tuple(cfg.windowed_pools()), window=window,
                         num_window_blocks=1)
    cache = KVCache.for_model(cfg, plan, BLOCK_SIZE, DTYPE)
    for i, (kv_heads, head_dim) in enumerate(cache.shapes):
        blocks = num_blocks
        if i in cache.pool_groups.get("window", ()):
            blocks = window_blocks(window, BLOCK_SIZE, batch, 256) + 1
        shape = (blocks, BLOCK_SIZE, kv_heads, head_dim)
        values = None if cache.v[i] is None else zeros_like_leaf(shape, DTYPE)
        cache.put(i, zeros_like_leaf(shape, DTYPE), values)
    states = cache.states
    if states is not None:
        states.conv = [zeros_like_leaf((batch, *a.shape[1:]), a.dtype) for a in states.conv]
        states.recurrent = [zeros_like_leaf((batch, *a.shape[1:]), a.dtype)
                            for a in states.recurrent]
    return cache


def _scheduler_output(cfg: ModelConfig, shape: StepShape, per_request: int) -> SchedulerOutput:
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    scheduled = []
    for i in range(shape.batch):
        chunk = shape.mixed and i == 0
        rows = shape.chunk if chunk else 1
        blocks = list(range(1 + i * per_request, 1 + (i + 1) * per_request))
        group_ids = {}
        if cfg.windowed_pools():
            group_ids["window"] = blocks  # a window table of the same length; never read
        if cfg.linear_attention:
            group_ids["states"] = [i]
        scheduled.append(ScheduledRequest(
            request_id=str(i), token_ids=[5] * rows, start_position=shape.context,
            block_ids=blocks, block_table_epoch=0, samples=not chunk, params=params,
            num_output_tokens=0 if chunk else 1, group_ids=group_ids))
    return SchedulerOutput(scheduled=scheduled)


class MlxLmStep:
    """mlx-lm's step as `generate_step` builds it: the model over the new tokens with its
    caches, logprobs, argmax; with `mixed`, the chunk's forward and the decodes' forward."""

    def __init__(self, config: dict, shape: StepShape) -> None:
        from mlx_lm.utils import _get_classes

        config = {**config, "model_type": MLX_LM_TYPES.get(config["model_type"],
                                                             config["model_type"])}
        with gpu_default_device():
            model_type, args_type = _get_classes(config)
        self.model = model_type(args_type.from_dict(config))
        self.model.eval()  # as mlx-lm loads it: kernels, not training's ops
        self.model.set_dtype(DTYPE)
        mx.eval(self.model.parameters())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        kv_heads = config["num_key_value_heads"]
        # What a layer's cache holds a token: keys and values, or MLA's latent and rope key.
        self._kv_shapes = ((1, config["kv_lora_rank"]), (1, config["qk_rope_head_dim"])) \
            if "kv_lora_rank" in config else ((kv_heads, head_dim),) * 2
        decodes = shape.batch - 1 if shape.mixed else shape.batch
        self.forwards = []  # (tokens, caches)
        if shape.mixed:
            self.forwards.append((_tokens(1, shape.chunk), self._caches(1, shape.context)))
        if decodes:
            self.forwards.append((_tokens(decodes, 1), self._caches(decodes, shape.context)))
        self._saved = [[dict(c.__dict__) for c in caches] for _, caches in self.forwards]

    def _caches(self, batch: int, context: int) -> list:
        from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

        caches = make_prompt_cache(self.model)
        for layer, cache in zip(self.model.layers, caches, strict=True):
            if hasattr(cache, "update_and_fetch"):
                keys, values = (zeros_like_leaf((batch, heads, context, width), DTYPE)
                                for heads, width in self._kv_shapes)
                cache.update_and_fetch(keys, values)
                mx.eval(cache.keys, cache.values)
                shape = list(cache.keys.shape)
                if isinstance(cache, RotatingKVCache):  # room to grow, as in steady decode
                    shape[2] = min(cache.max_size, context + cache.step)
                cache.keys = zeros_like_leaf(shape, DTYPE)
                cache.values = zeros_like_leaf((*shape[:3], cache.values.shape[3]), DTYPE)
            else:  # a linear-attention layer's conv and recurrent states
                net = layer.linear_attn
                cache[0] = zeros_like_leaf((batch, net.conv_kernel_size - 1, net.conv_dim),
                                           DTYPE)
                cache[1] = zeros_like_leaf((batch, net.num_v_heads, net.head_v_dim,
                                            net.head_k_dim), mx.float32)
        return caches

    def build(self) -> list[mx.array]:
        outputs = []
        with gpu_default_device():
            for tokens, caches in self.forwards:
                logits = self.model(tokens, cache=caches)[:, -1, :]
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                sampled = mx.argmax(logprobs, axis=-1)
                mx.async_eval(sampled)
                sampled.tolist()  # generate_step reads each token
                outputs += [sampled, *(a for c in caches for a in c.state
                                       if isinstance(a, mx.array))]
        return outputs

    def reset(self) -> None:
        for (_, caches), saved in zip(self.forwards, self._saved, strict=True):
            for cache, state in zip(caches, saved, strict=True):
                cache.__dict__.update({k: _fresh_state(v) for k, v in state.items()})


def _tokens(batch: int, length: int) -> mx.array:
    tokens = mx.full((batch, length), 5)
    mx.eval(tokens)
    return tokens


def _fresh_state(value):
    if isinstance(value, list):
        return [_fresh_state(v) for v in value]
    return _fresh(value) if isinstance(value, mx.array) else value
