"""`/v1/embeddings` with the official openai client, `/v1/rerank` and `/v1/score`, on a real
server over tiny random models: the answers equal sentence-transformers' (embeddings) and
transformers' (Qwen3-Reranker's yes/no scores), bad input is a 400."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from embedding_models import NO, YES, build_embedding_model, build_reranker, sentence_embeddings
from server_helpers import running_server
from tokenizers import Tokenizer

from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from server.openai.rerank_prompt import rerank_prompt

MAX_MODEL_LEN = 128


def _engine(path, task="auto"):
    return build_engine(EngineConfig(model_dir=path, task=task, max_model_len=MAX_MODEL_LEN,
                                     kv_cache_memory=16 << 20))


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed")
    build_embedding_model(path, prompts={"query": "w9 w8 "})
    with running_server(_engine(path), "tiny-embed") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x"), path


def _expected(path, text: str, dimensions=None, **options) -> np.ndarray:
    """sentence-transformers' embedding of `text`, cut to its first `dimensions` and
    normalized again (OpenAI's `dimensions`; its own `truncate_dim` cuts the normalized
    vector and leaves it so)."""
    [vector] = sentence_embeddings(path, [text], truncate_dim=dimensions, **options)
    return vector / np.linalg.norm(vector)


def test_embeddings_of_texts_and_token_ids_equal_sentence_transformers(embedding_server):
    client, path = embedding_server
    texts = ["w3 w4 w5", "w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20", "w7"]
    result = client.embeddings.create(model="tiny-embed", input=texts)
    assert [d.index for d in result.data] == [0, 1, 2]
    np.testing.assert_allclose([item.embedding for item in result.data],
                               sentence_embeddings(path, texts), atol=1e-4)
    assert result.usage.prompt_tokens == result.usage.total_tokens == 15
    by_ids = client.embeddings.create(model="tiny-embed", input=[[3, 4, 5], [7]])
    np.testing.assert_allclose(by_ids.data[1].embedding, _expected(path, "w7"), atol=1e-4)
    assert {tuple(card.model_extra["capabilities"]) for card in client.models.list().data} == {
        ("embeddings",)}  # it has no head to generate with


def test_base64_dimensions_and_named_prompt(embedding_server):
    client, path = embedding_server
    raw = client.embeddings.with_raw_response.create(
        model="tiny-embed", input="w3 w4", encoding_format="base64", dimensions=16)
    encoded = raw.http_response.json()["data"][0]["embedding"]
    vector = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    np.testing.assert_allclose(vector, _expected(path, "w3 w4", 16), atol=1e-4)
    query = client.embeddings.create(model="tiny-embed", input="w3 w4",
                                     extra_body={"prompt_name": "query"})
    np.testing.assert_allclose(query.data[0].embedding,
                               _expected(path, "w3 w4", prompt_name="query"), atol=1e-4)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [list(range(1, 100)) * 2]}, "input"),
    ({"input": ["w1"] * 10_000}, "input"),
    ({"input": "w1", "dimensions": 65}, "dimensions"),
    ({"input": "w1", "dimensions": 0}, "dimensions"),
    ({"input": "w1", "dimensions": -3}, "dimensions"),
    ({"input": "w1", "extra_body": {"prompt_name": "passage"}}, "prompt_name"),
])
def test_bad_embedding_requests_are_400s(embedding_server, body, param):
    client, _ = embedding_server
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="tiny-embed", **body)
    assert error.value.body["param"] == param


def test_a_chat_model_refuses_embeddings_and_an_embedding_model_refuses_rerank(tmp_path):
    from tiny_models import build_tiny_model
    build_tiny_model("llama", tmp_path)
    with running_server(_engine(tmp_path), "chat") as url:
        with pytest.raises(openai.BadRequestError, match="text generation, not embeddings"):
            openai.OpenAI(base_url=f"{url}/v1", api_key="x").embeddings.create(
                model="chat", input="w1")
        answer = httpx.post(f"{url}/v1/rerank", json={"query": "w1", "documents": ["w2"]})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "model"


def _reference_scores(model, path, query: str, documents: list[str]) -> list[float]:
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    scores = []
    for document in documents:
        ids = tokenizer.encode(rerank_prompt(query, document)).ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        scores.append(torch.softmax(logits[[NO, YES]], dim=0)[1].item())
    return scores


def test_rerank_and_score_equal_transformers(tmp_path):
    path = tmp_path / "tiny-Reranker"
    path.mkdir()
    reference = build_reranker(path)
    assert _engine(path).pooling is None  # a causal LM generates unless told otherwise
    query, documents = "w3 yes w4", ["w5 w6 w7", "no w9", "w11 w12 w13 w14 w15"]
    expected = _reference_scores(reference, path, query, documents)
    with running_server(_engine(path, task="rerank"), "tiny-reranker") as url:
        answer = httpx.post(f"{url}/v1/rerank", json={
            "model": "tiny-reranker", "query": query, "documents": documents, "top_n": 2})
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in results] == order
        for r in results:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
            assert r["document"]["text"] == documents[r["index"]]
        scored = httpx.post(f"{url}/v1/score", json={"text_1": query, "text_2": documents})
        assert [d["score"] for d in scored.json()["data"]] == pytest.approx(expected, abs=1e-4)
        for document, score in zip(documents, expected, strict=True):  # each alone
            alone = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": [document]})
            [result] = alone.json()["results"]
            assert result["index"] == 0
            assert result["relevance_score"] == pytest.approx(score, abs=1e-4)
            scored = httpx.post(f"{url}/v1/score", json={"text_1": query, "text_2": document})
            assert [d["score"] for d in scored.json()["data"]] == pytest.approx([score], abs=1e-4)
        empty = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": []})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"
        for top_n in (0, -1):
            refused = httpx.post(f"{url}/v1/rerank",
                                 json={"query": query, "documents": documents, "top_n": top_n})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_n"
        cards = httpx.get(f"{url}/v1/models").json()["data"]
        assert all("rerank" in card["capabilities"] for card in cards)
