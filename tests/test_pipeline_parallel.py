"""Pipeline parallelism on one host, ranks over MLX's ring backend on loopback: each rank keeps
only its layers (and pools), a step's requests pass through in micro-batches, and two or three
ranks give the tokens one gives (dense, MoE and hybrid models)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from parallel_run import greedy_tokens, greedy_tokens_in_a_process
from tiny_models import build_tiny_model

from metal_engine.config import EngineConfig
from metal_engine.loading.weights import load_model
from metal_engine.parallel.pipeline import keep_stage, micro_batches, stage_layers, stage_pools
from scheduler import SamplingParams
from scheduler.output import ScheduledRequest, SchedulerOutput


def _scheduled(lengths: list[int]) -> SchedulerOutput:
    return SchedulerOutput(scheduled=[
        ScheduledRequest(str(i), [1] * n, 0, [], 0, True, SamplingParams(), 0)
        for i, n in enumerate(lengths)])


def test_micro_batches_are_contiguous_runs_of_about_equal_tokens():
    def split(lengths, count):
        return [[int(s.request_id) for s in b.scheduled]
                for b in micro_batches(_scheduled(lengths), count)]

    assert split([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    assert split([100, 1, 1], 2) == [[0], [1, 2]]
    assert split([1], 3) == [[0]]  # never an empty micro-batch
    assert split([5, 5, 5], 3) == [[0], [1], [2]]


def test_layers_split_in_contiguous_runs():
    assert [list(stage_layers(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="2 layers cannot be split over 3 ranks"):
        stage_layers(2, 0, 3)


def test_a_stage_keeps_only_its_layers_and_pools(tmp_path):
    build_tiny_model("qwen3_5_text", tmp_path)  # linear, full, linear, full attention
    whole = load_model(tmp_path, mx.float32)
    last = load_model(tmp_path, mx.float32, shard=lambda m: keep_stage(m, 1, 2))
    names = {n for n, _ in tree_flatten(last.parameters())}
    assert names and all(n.startswith(("model.layers.2.", "model.layers.3.", "model.norm."))
                         for n in names)
    assert len(names) < len(tree_flatten(whole.parameters())) / 2
    assert stage_pools(whole, 0, 2) == {0} and stage_pools(whole, 1, 2) == {1}


def test_tensor_and_pipeline_parallelism_do_not_combine_yet(tmp_path):
    with pytest.raises(ValueError, match="does not combine with --pipeline-parallel-size"):
        EngineConfig(model_dir=tmp_path, tensor_parallel_size=2, pipeline_parallel_size=2)


@pytest.mark.parametrize(("family", "ranks"), [("phi3", 2), ("qwen3_moe", 3), ("qwen3_next", 2)])
def test_pipeline_ranks_give_one_ranks_greedy_tokens(family, ranks, tmp_path):
    build_tiny_model(family, tmp_path)
    expected = greedy_tokens(tmp_path)
    assert greedy_tokens_in_a_process(tmp_path, pipeline=ranks) == expected


@pytest.mark.slow
def test_two_pipeline_ranks_give_one_ranks_greedy_tokens_on_the_default_model(
        default_model_dir):
    expected = greedy_tokens(default_model_dir)
    assert greedy_tokens_in_a_process(default_model_dir, pipeline=2) == expected
