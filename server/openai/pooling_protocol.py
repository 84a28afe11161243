"""Request and response bodies of `/v1/embeddings` (OpenAI's), `/v1/rerank` (the Jina/Cohere
shape vLLM and llama-server expose) and `/v1/score` (vLLM's)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's limit on the inputs of one embeddings request; rerank's documents share it.
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    # A prompt named in the model's config_sentence_transformers.json (e.g. "query"),
    # put before every input, as sentence-transformers' `prompt_name`.
    prompt_name: str | None = None
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: PoolingUsage


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    instruction: str | None = None  # Qwen3-Reranker's <Instruct> (default: web search)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: PoolingUsage


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    instruction: str | None = None


class Score(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Score]
    usage: PoolingUsage
