"""`bench throughput` (the engine driven directly) and `bench step` (host overhead per step)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import metal_engine  # noqa: F401  # isort: skip  (loads the optimized BLAS before mlx)
import mlx.core as mx
import numpy as np

from kernels_metal.cost import decode_step, step_cost
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.ops import ReferenceOps
from metal_engine.cache.kv_cache import KVCache
from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.moe import set_dispatch
from metal_engine.runner import ModelRunner
from scheduler import SamplingParams, Scheduler, SchedulerConfig


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", type=Path, help="default: the bundled model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes")
    parser.add_argument("--moe-dispatch", choices=("auto", "gather", "grouped"), default="auto",
                        help="how a MoE model's experts run: gathered matmuls, one product per "
                             "chosen expert, or the backend's choice (default)")
    parser.add_argument("--result-json", type=Path)


def run_throughput(args: argparse.Namespace) -> int:
    model_dir = args.model_dir or _default_model_dir()
    engine = build_engine(EngineConfig(
        model_dir=model_dir,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
    ))
    dispatch = None if args.moe_dispatch == "auto" else args.moe_dispatch
    expert_sets = set_dispatch(engine.runner.model, dispatch)
    _run_to_completion(engine, 2, args.input_len, 4)  # warm-up
    start = time.perf_counter()
    output_tokens = _run_to_completion(engine, args.num_prompts, args.input_len, args.output_len)
    elapsed = time.perf_counter() - start
    result = {
        "num_prompts": args.num_prompts,
        "moe_dispatch": args.moe_dispatch if expert_sets else None,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "elapsed_s": elapsed,
        "requests_per_s": args.num_prompts / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (output_tokens + args.num_prompts * args.input_len) / elapsed,
    }
    _report(result, args.result_json)
    return 0


def _run_to_completion(engine: LLMEngine, num: int, input_len: int, output_len: int) -> int:
    rng = np.random.default_rng(0)
    # Ids the model can embed and the tokenizer can decode.
    vocab = min(len(engine.tokenizer), engine.runner.model.config.vocab_size)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(num):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}",
                           rng.integers(0, vocab, size=input_len).tolist(), params)
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", type=Path, help="tokenizer source")
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--result-json", type=Path)


def run_step(args: argparse.Namespace) -> int:
    """Time decode steps with the model stubbed out: what is left is the engine's host work.
    Also reports what the same steps would cost the Metal kernels for the model of
    `model_dir` (bytes, FLOPs, dispatches), from its kernel plan."""
    model_dir = args.model_dir or _default_model_dir()
    results = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        engine = _stub_engine(model_dir, batch, args.context_len + args.steps + 8)
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(str(i), rng.integers(0, 1000, size=args.context_len).tolist(),
                               params)
        while any(r.num_computed_tokens == 0 for r in engine.scheduler.requests.values()):
            engine.step()  # prefill
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        results[batch] = {"median_ms": statistics.median(times), "p90_ms": _p90(times)}
    config = ModelConfig.from_model_dir(model_dir)
    costs = {
        batch: kernel_cost(config, decode_step(batch, args.context_len))
        for batch in (int(b) for b in args.batch_sizes.split(","))
    }
    _report({"host_overhead_per_decode_step": results,
             "metal_kernel_cost_per_decode_step": costs}, args.result_json)  # fmt: skip
    return 0


def kernel_cost(config: ModelConfig, meta: AttentionMetadata, itemsize: int = 2) -> dict:
    """The Metal kernels' cost of one step over all of `config`'s layers (a float16 KV pool,
    as on Apple GPUs), from `kernels_metal.cost`."""
    layers = [step_cost(meta, config.num_attention_heads, *config.kv_shape(layer), itemsize,
                        window=config.window(layer))
              for layer in range(config.num_hidden_layers)]  # fmt: skip
    totals = {name: sum(cost.to_json()[name] for cost in layers) for name in layers[0].to_json()}
    return {"layers": len(layers), **totals}


class _StubModel:
    """Stands in for the model: no layers, a tiny vocabulary, no device work to speak of."""

    ops = ReferenceOps()  # a lazy MLX forward: nothing evaluated while it is built
    has_head = True  # it generates

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def __call__(self, input_ids, positions, meta, cache, images=None) -> mx.array:
        return mx.zeros((input_ids.shape[0], 1))

    def logits(self, hidden: mx.array) -> mx.array:
        return mx.zeros((hidden.shape[0], 8))


def _stub_engine(model_dir: Path, batch: int, context: int) -> LLMEngine:
    from metal_engine.loading.tokenizer_loading import load_tokenizer

    block_size = 16
    num_blocks = batch * (-(-context // block_size))
    cache = KVCache((), num_blocks, block_size, mx.float32)
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=batch,
        max_num_batched_tokens=max(batch * context, 1), max_model_len=context,
    ))
    model = _StubModel(ModelConfig.from_model_dir(model_dir))
    tokenizer = load_tokenizer(model_dir)
    return LLMEngine(ModelRunner(model, cache), scheduler, tokenizer, "stub")


def _default_model_dir() -> Path:
    from convert import ensure_default_model

    return ensure_default_model()


def _p90(values: list[float]) -> float:
    return float(np.percentile(values, 90))


def _report(result: dict, path: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        path.write_text(text + "\n")
