"""Pooling requests through the unified step: embeddings equal transformers' hidden states
pooled as each kind says (and sentence-transformers' own where the files say how), whole
prompts and chunked, batched with each other and with generating requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from embedding_models import build_embedding_model, hidden_states, sentence_embeddings

from convert import convert_model
from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from scheduler import SamplingParams
from scheduler.pooling_params import PoolingParams

PROMPTS = {"a": [3, 9, 27, 81, 5], "b": list(range(10, 41)), "c": [7], "d": list(range(60, 80))}
POOL_PARAMS = SamplingParams(max_tokens=1)


def _engine(path, budget: int):
    return build_engine(EngineConfig(model_dir=path, max_model_len=128, kv_cache_memory=16 << 20,
                                     max_num_batched_tokens=budget))


def _pool(engine, prompts: dict[str, list[int]], pooling: PoolingParams) -> dict:
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, POOL_PARAMS, pooling=pooling)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.finish_reason == "stop" and not output.new_token_ids
            outputs[output.request_id] = output
    return outputs


def _expected(hidden: torch.Tensor, kind: str, normalize: bool, dimensions=None) -> np.ndarray:
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]
    vector = vector[:dimensions] if dimensions else vector
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.numpy()


@pytest.mark.parametrize("budget", [512, 8], ids=["whole", "chunked"])
@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_vectors_equal_transformers(tmp_path, budget, kind):
    reference = build_embedding_model(tmp_path)
    engine = _engine(tmp_path, budget)
    outputs = _pool(engine, PROMPTS, PoolingParams(kind))
    for request_id, ids in PROMPTS.items():
        expected = _expected(hidden_states(reference, ids), kind, normalize=True)
        np.testing.assert_allclose(outputs[request_id].pooled, expected, atol=1e-4)
        assert outputs[request_id].num_prompt_tokens == len(ids)


def test_matryoshka_dimensions_and_raw_vectors(tmp_path):
    reference = build_embedding_model(tmp_path)
    engine = _engine(tmp_path, 512)
    ids = PROMPTS["b"]
    cut = _pool(engine, {"cut": ids}, PoolingParams("last", dimensions=16))["cut"].pooled
    raw = _pool(engine, {"raw": ids}, PoolingParams("last", normalize=False))["raw"].pooled
    hidden = hidden_states(reference, ids)
    np.testing.assert_allclose(cut, _expected(hidden, "last", True, 16), atol=1e-4)
    np.testing.assert_allclose(raw, _expected(hidden, "last", False), atol=1e-4)
    with pytest.raises(ValueError, match="dimensions"):
        engine.add_request("wide", ids, POOL_PARAMS, pooling=PoolingParams(dimensions=65))


def test_last_token_pooling_reuses_the_prefix_cache(tmp_path):
    reference = build_embedding_model(tmp_path)
    engine = _engine(tmp_path, 512)
    ids = list(range(1, 40))
    first = _pool(engine, {"first": ids}, PoolingParams())["first"]
    again = _pool(engine, {"again": ids}, PoolingParams())["again"]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    np.testing.assert_allclose(again.pooled, _expected(hidden_states(reference, ids), "last", True),
                               atol=1e-4)
    mean = _pool(engine, {"mean": ids}, PoolingParams("mean"))["mean"]
    assert mean.num_cached_tokens == 0  # mean pooling reads every row: no cached prefix


def test_a_model_without_lm_head_refuses_generation(tmp_path):
    build_embedding_model(tmp_path)
    engine = _engine(tmp_path, 512)
    assert not engine.runner.model.has_head
    with pytest.raises(ValueError, match="no LM head"):
        engine.add_request("gen", [1, 2, 3], SamplingParams(max_tokens=4))


def test_pooling_beside_generation_with_async_scheduling(tmp_path):
    from embedding_models import build_reranker
    from tiny_models import hf_greedy

    reference = build_reranker(tmp_path)
    engine = build_engine(EngineConfig(model_dir=tmp_path, max_model_len=128,
                                       kv_cache_memory=16 << 20, max_num_batched_tokens=8,
                                       async_scheduling=True))
    ids = PROMPTS["b"]
    engine.add_request("gen", ids, SamplingParams(max_tokens=6, temperature=0.0))
    engine.add_request("pool", ids[:20], POOL_PARAMS, pooling=PoolingParams("mean"))
    tokens, pooled = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "gen":
                tokens += output.new_token_ids
            elif output.finished:
                pooled = output.pooled
    assert tokens == hf_greedy(reference, ids, 6)
    np.testing.assert_allclose(pooled, _expected(hidden_states(reference.model, ids[:20]),
                                                 "mean", True), atol=1e-4)


def test_a_converted_embedding_model_pools_as_its_sentence_transformers_files_say(tmp_path):
    build_embedding_model(tmp_path / "hf", pooling="mean_tokens", normalize=True)
    out = convert_model(tmp_path / "hf", tmp_path / "converted", progress=False)
    engine = _engine(out, 512)
    assert (engine.pooling.kind, engine.pooling.normalize) == ("mean", True)
    ids = PROMPTS["d"]
    pooled = _pool(engine, {"d": ids}, PoolingParams(engine.pooling.kind))["d"].pooled
    [expected] = sentence_embeddings(tmp_path / "hf", [" ".join(f"w{i}" for i in ids)])
    np.testing.assert_allclose(pooled, expected, atol=1e-4)
