"""BERT-style encoders through the unified step: embeddings equal sentence-transformers' and
cross-encoder scores transformers' logits, alone and batched, every prompt computed
whole in one step, and what `--task` each checkpoint serves."""

from __future__ import annotations

import json

import numpy as np
import pytest
from embedding_models import sentence_embeddings
from encoder_models import (
    FAMILIES,
    MAX_POSITIONS,
    build_cross_encoder,
    build_embedding_encoder,
    pair_logit,
    tokenizer_of,
)

from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from scheduler import SamplingParams
from scheduler.pooling_params import PoolingParams
from server.openai.cross_encoder import pair_prompts

TEXTS = ["w5 w6 w7", " ".join(f"w{i}" for i in range(10, 50)), "w9", "w60 w61 w62 w63 w64"]
QUERY = "w7 w8"
DOCUMENTS = ["w9 w10 w11", " ".join(f"w{i}" for i in range(20, 45)), "w100", "w8 w7"]


def _engine(path, task="auto", budget=None):
    return build_engine(EngineConfig(model_dir=path, task=task, kv_cache_memory=16 << 20,
                                     max_num_batched_tokens=budget))


def _pool(engine, prompts: list[list[int]], pooling: PoolingParams, together: bool) -> list:
    """Each prompt's pooled output: all queued at once, or each alone."""
    groups = [list(enumerate(prompts))] if together else [[p] for p in enumerate(prompts)]
    pooled, steps = {}, 0
    for group in groups:
        for i, ids in group:
            engine.add_request(str(i), ids, SamplingParams(max_tokens=1), pooling=pooling)
        while engine.has_unfinished_requests():
            steps += 1
            for output in engine.step():
                pooled[int(output.request_id)] = np.array(output.pooled)
    return [pooled[i] for i in range(len(prompts))], steps


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_equal_sentence_transformers_alone_and_batched(tmp_path, family, pooling):
    build_embedding_encoder(family, tmp_path, pooling=pooling)
    engine = _engine(tmp_path)
    config = engine.pooling
    assert (config.task, config.kind, config.normalize) == ("embed", pooling, True)
    tokenizer = tokenizer_of(tmp_path)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    expected = sentence_embeddings(tmp_path, TEXTS)
    for together in (False, True):
        vectors, steps = _pool(engine, prompts, PoolingParams(pooling), together)
        assert steps == (1 if together else len(TEXTS))  # every prompt whole, in one step
        for vector, want in zip(vectors, expected, strict=True):
            np.testing.assert_allclose(vector, want, atol=1e-4)
            assert float(vector @ want) == pytest.approx(1.0, abs=1e-4)  # cosine


def test_prompts_past_the_step_budget_wait_whole_for_the_next_step(tmp_path):
    build_embedding_encoder("bert", tmp_path, pooling="mean", normalize=False)
    engine = _engine(tmp_path, budget=8)  # raised to the encoder's longest prompt
    assert engine.scheduler.config.max_num_batched_tokens == MAX_POSITIONS
    tokenizer = tokenizer_of(tmp_path)
    texts = [" ".join(f"w{i}" for i in range(n, n + 40)) for n in (10, 60)]
    vectors, steps = _pool(engine, [tokenizer(t)["input_ids"] for t in texts],
                           PoolingParams("mean", normalize=False), together=True)
    assert steps == 2  # 42 + 42 tokens: the second waits rather than splits
    np.testing.assert_allclose(vectors, sentence_embeddings(tmp_path, texts), atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_cross_encoder_scores_equal_transformers_alone_and_batched(tmp_path, family):
    reference = build_cross_encoder(family, tmp_path)
    engine = _engine(tmp_path)
    config = engine.pooling
    assert (config.task, config.scorer, config.sigmoid) == ("rerank", "classifier", True)
    tokenizer = tokenizer_of(tmp_path)
    prompts = pair_prompts(tokenizer, [QUERY] * len(DOCUMENTS), DOCUMENTS)
    expected = [pair_logit(reference, tokenizer, QUERY, d) for d in DOCUMENTS]
    for together in (False, True):
        logits, _ = _pool(engine, prompts, PoolingParams("cls", normalize=False,
                                                         logit_token_ids=(0,)), together)
        np.testing.assert_allclose([x[0] for x in logits], expected, atol=1e-4)


def test_token_types_reach_the_encoder(tmp_path):
    """BERT's second segment has its own embedding: its pair scores differ from the same ids
    read as one segment, and only the typed ones equal transformers'."""
    reference = build_cross_encoder("bert", tmp_path)
    engine = _engine(tmp_path)
    tokenizer = tokenizer_of(tmp_path)
    encoded = tokenizer(QUERY, DOCUMENTS[0])
    assert set(encoded["token_type_ids"]) == {0, 1}
    pooling = PoolingParams("cls", normalize=False, logit_token_ids=(0,))
    (typed,), _ = _pool(engine, pair_prompts(tokenizer, [QUERY], DOCUMENTS[:1]), pooling, True)
    (untyped,), _ = _pool(engine, [encoded["input_ids"]], pooling, True)
    expected = pair_logit(reference, tokenizer, QUERY, DOCUMENTS[0])
    assert typed[0] == pytest.approx(expected, abs=1e-4)
    assert abs(untyped[0] - expected) > 1e-3


def test_what_each_task_serves(tmp_path):
    embedder, cross = tmp_path / "embed", tmp_path / "cross"
    build_embedding_encoder("bert", embedder)
    build_cross_encoder("xlm-roberta", cross, "torch.nn.modules.linear.Identity")
    assert _engine(cross).pooling.sigmoid is False  # its config names the identity
    assert _engine(cross, task="score").pooling.scorer == "classifier"
    with pytest.raises(ValueError, match="--task rerank"):
        _engine(cross, task="embed")
    with pytest.raises(ValueError, match="cannot generate"):
        _engine(embedder, task="generate")
    with pytest.raises(ValueError, match="no classifier head"):
        _engine(embedder, task="rerank")
    engine = _engine(embedder)
    with pytest.raises(ValueError, match="no LM head"):
        engine.add_request("gen", [2, 5, 3], SamplingParams(max_tokens=4))


def test_an_encoder_refuses_contexts_past_its_positions_and_decoder_configs(tmp_path):
    build_embedding_encoder("xlm-roberta", tmp_path)
    engine = _engine(tmp_path)
    assert engine.max_model_len == MAX_POSITIONS  # its 66 rows, counted from row 2
    with pytest.raises(ValueError, match="learned positions"):
        build_engine(EngineConfig(model_dir=tmp_path, max_model_len=MAX_POSITIONS + 8,
                                  allow_long_max_model_len=True, kv_cache_memory=16 << 20))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "is_decoder": True}))
    with pytest.raises(ValueError, match="bidirectional encoders only"):
        _engine(tmp_path)


def test_converted_encoders_serve_as_their_checkpoints(tmp_path):
    from convert import convert_model
    from convert.model_ref import loads_as_is

    embed_source, cross_source = tmp_path / "embed", tmp_path / "cross"
    build_embedding_encoder("bert", embed_source, pooling="mean")
    cross = build_cross_encoder("bert", cross_source)
    assert loads_as_is(embed_source) and loads_as_is(cross_source)
    tokenizer = tokenizer_of(embed_source)
    embed_out = convert_model(embed_source, tmp_path / "embed-out", progress=False)
    engine = _engine(embed_out)
    assert (engine.pooling.kind, engine.pooling.normalize) == ("mean", True)
    (vector,), _ = _pool(engine, [tokenizer(TEXTS[1])["input_ids"]], PoolingParams("mean"), True)
    np.testing.assert_allclose(vector, sentence_embeddings(embed_source, TEXTS[1:2])[0],
                               atol=1e-4)
    cross_out = convert_model(cross_source, tmp_path / "cross-out", progress=False)
    engine = _engine(cross_out)
    assert engine.pooling.scorer == "classifier"
    pooling = PoolingParams("cls", normalize=False, logit_token_ids=(0,))
    (logit,), _ = _pool(engine, pair_prompts(tokenizer, [QUERY], DOCUMENTS[1:2]), pooling, True)
    assert logit[0] == pytest.approx(pair_logit(cross, tokenizer, QUERY, DOCUMENTS[1]), abs=1e-4)
