"""A BERT embedding model behind a real server, driven by the official openai client, and a
cross-encoder behind `/v1/rerank` and `/v1/score`: the answers equal sentence-transformers'
(SentenceTransformer's and CrossEncoder's), bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from embedding_models import sentence_embeddings
from encoder_models import (
    MAX_POSITIONS,
    build_cross_encoder,
    build_embedding_encoder,
    cross_encoder_scores,
    tokenizer_of,
)
from server_helpers import running_server

from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine

TEXTS = ["w5 w6 w7", " ".join(f"w{i}" for i in range(10, 50)), "w9", "w60 w61 w62 w63"]
TOO_LONG = " ".join(f"w{i}" for i in range(5, 5 + MAX_POSITIONS))


def _server(path, name: str):
    return running_server(build_engine(EngineConfig(model_dir=path, kv_cache_memory=16 << 20)),
                          name)


@pytest.fixture(scope="module")
def bert_embeddings(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert-embed")
    build_embedding_encoder("bert", path, pooling="cls")
    tokenizer = tokenizer_of(path)
    with _server(path, "tiny-bge") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x"), url, path, tokenizer


def test_embeddings_equal_sentence_transformers_batched_and_alone(bert_embeddings):
    client, _, path, tokenizer = bert_embeddings
    expected = sentence_embeddings(path, TEXTS)
    batched = client.embeddings.create(model="tiny-bge", input=TEXTS)
    alone = [client.embeddings.create(model="tiny-bge", input=t).data[0] for t in TEXTS]
    assert [d.index for d in batched.data] == [0, 1, 2, 3]
    for got, lone, want in zip(batched.data, alone, expected, strict=True):
        np.testing.assert_allclose(got.embedding, want, atol=1e-4)
        np.testing.assert_allclose(lone.embedding, want, atol=1e-4)
        assert float(np.dot(got.embedding, want)) == pytest.approx(1.0, abs=1e-4)
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)  # [CLS] and [SEP] counted
    assert batched.usage.prompt_tokens == batched.usage.total_tokens == tokens
    cards = client.models.list().data
    assert {tuple(card.model_extra["capabilities"]) for card in cards} == {("embeddings",)}


def test_an_input_may_fill_every_position(bert_embeddings):
    client, _, path, tokenizer = bert_embeddings
    full = " ".join(f"w{i}" for i in range(5, 3 + MAX_POSITIONS))  # + [CLS] and [SEP]
    assert len(tokenizer(full)["input_ids"]) == MAX_POSITIONS
    got = client.embeddings.create(model="tiny-bge", input=full).data[0].embedding
    np.testing.assert_allclose(got, sentence_embeddings(path, [full])[0], atol=1e-4)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [TOO_LONG]}, "input"),
    ({"input": [list(range(5, 6 + MAX_POSITIONS))]}, "input"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(bert_embeddings, body, param):
    client, url, _, _ = bert_embeddings
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="tiny-bge", **body)
    assert error.value.body["param"] == param
    completion = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 2})
    assert completion.status_code == 400


@pytest.mark.parametrize(("family", "activation"), [
    ("bert", None), ("xlm-roberta", "torch.nn.modules.linear.Identity")])
def test_cross_encoder_rerank_and_score_equal_sentence_transformers(tmp_path, family, activation):
    build_cross_encoder(family, tmp_path, activation)
    query = "w7 w8"
    documents = ["w9 w10 w11", " ".join(f"w{i}" for i in range(20, 45)), "w100", "w8 w7"]
    expected = cross_encoder_scores(tmp_path, query, documents)  # sigmoid unless Identity
    with _server(tmp_path, "tiny-reranker") as url:
        answer = httpx.post(f"{url}/v1/rerank", json={
            "model": "tiny-reranker", "query": query, "documents": documents, "top_n": 3})
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -expected[i])[:3]
        for r in results:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
        scored = httpx.post(f"{url}/v1/score", json={"text_1": query, "text_2": documents[1]})
        assert scored.json()["data"][0]["score"] == pytest.approx(expected[1], abs=1e-4)
        too_long = httpx.post(f"{url}/v1/rerank", json={"query": query,
                                                        "documents": ["w9", TOO_LONG]})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["param"] == "documents"
        embed = httpx.post(f"{url}/v1/embeddings", json={"input": "w5"})
        assert embed.status_code == 400 and embed.json()["error"]["param"] == "model"
        cards = httpx.get(f"{url}/v1/models").json()["data"]
        assert all(card["capabilities"] == ["rerank"] for card in cards)
