"""`POST /v1/embeddings`, `/v1/rerank` and `/v1/score`: each input a pooling request through
the engine's step (all of one HTTP request's inputs batched in it), answered once all pooled.

A model serves embeddings or rerank scores as its dir says (metal_engine.loading.pooling_config);
asked for the other, or a generating model asked for either, the answer is a 400 naming why.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import numpy as np
from fastapi import APIRouter

from metal_engine.loading.pooling_config import PoolingConfig, PoolingTask
from metal_engine.outputs import RequestOutput
from scheduler.pooling_params import PoolingParams, PoolingRefused
from scheduler.sampling_params import SamplingParams
from server.async_engine import AsyncEngine
from server.core.prompt_ids import check_token_ids
from server.http.errors import APIError
from server.openai.cross_encoder import classifier_score, pair_prompts
from server.openai.pooling_protocol import (
    MAX_INPUTS,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    Score,
    ScoreRequest,
    ScoreResponse,
)
from server.openai.rerank_prompt import relevance, rerank_prompt, yes_no_token_ids

# A pooling request generates nothing; its sampling params only pass the engine's checks.
_NO_SAMPLING = SamplingParams(max_tokens=1)


def pooling_router(async_engine: AsyncEngine, served_model_name: str) -> APIRouter:
    router = APIRouter()
    config: PoolingConfig | None = getattr(async_engine.engine, "pooling", None)

    def require(task: PoolingTask, what: str) -> PoolingConfig:
        if config is None or config.task != task:
            serves = "text generation" if config is None else f"{config.task} requests"
            raise APIError(f"The model {served_model_name!r} serves {serves}, not {what}: "
                           "serve a model made for them (docs/embeddings.md).", param="model",
                           code="model_not_supported")
        return config

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> EmbeddingResponse:
        config = require("embed", "embeddings")
        prompts = await _embedding_prompts(async_engine, body, config)
        pooling = PoolingParams(config.kind, config.normalize, body.dimensions)
        outputs = await _pool_all(async_engine, prompts, pooling, "input")
        data = [Embedding(index=i, embedding=_encoded(o.pooled, body.encoding_format))
                for i, o in enumerate(outputs)]
        return EmbeddingResponse(data=data, model=served_model_name, usage=_usage(outputs))

    @router.post("/v1/rerank")
    async def rerank(body: RerankRequest) -> RerankResponse:
        config = require("rerank", "rerank")
        if not body.documents:
            raise APIError("documents is empty: send at least one document.", param="documents")
        scores, usage = await _scores(async_engine, config, [body.query] * len(body.documents),
                                      body.documents, body.instruction, "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=body.documents[i])
                                if body.return_documents else None) for i in order]
        return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=served_model_name,
                              results=results, usage=usage)

    @router.post("/v1/score")
    async def score(body: ScoreRequest) -> ScoreResponse:
        config = require("rerank", "scores")
        queries, documents = _score_pairs(body.text_1, body.text_2)
        scores, usage = await _scores(async_engine, config, queries, documents,
                                      body.instruction, "text_2")
        return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()),
                             model=served_model_name, usage=usage,
                             data=[Score(index=i, score=s) for i, s in enumerate(scores)])

    return router


async def _embedding_prompts(async_engine: AsyncEngine, body: EmbeddingRequest,
                             config: PoolingConfig) -> list[list[int]]:
    """The inputs as token id lists (text tokenized with the prompt named, if any)."""
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs or any(len(i) == 0 for i in inputs):
        raise APIError("input is empty: send a string, an array of strings or of token ids "
                       "with at least one item each.", param="input")
    if len(inputs) > MAX_INPUTS:
        raise APIError(f"input has {len(inputs)} items; at most {MAX_INPUTS} per request.",
                       param="input")
    prefix = ""
    if body.prompt_name is not None:
        if body.prompt_name not in config.prompts:
            raise APIError(f"prompt_name {body.prompt_name!r} is not one of the model's "
                           f"prompts {sorted(config.prompts)}.", param="prompt_name")
        prefix = config.prompts[body.prompt_name]
    texts = [i for i in inputs if isinstance(i, str)]
    tokenized = iter(await async_engine.prepare(_tokenize, async_engine.tokenizer,
                                                [prefix + t for t in texts]))
    prompts = [next(tokenized) if isinstance(i, str) else list(i) for i in inputs]
    for ids in prompts:
        check_token_ids(async_engine.tokenizer, ids, "input")
    return prompts


async def _scores(async_engine: AsyncEngine, config: PoolingConfig, queries: list[str],
                  documents: list[str], instruction: str | None,
                  param: str) -> tuple[list[float], PoolingUsage]:
    """The relevance of each (query, document) pair: a cross-encoder's classifier score over
    the pair's encoding (its first token pooled), or Qwen3-Reranker's P("yes") over its
    template (the last token's "yes" and "no" logits)."""
    if len(documents) > MAX_INPUTS:
        raise APIError(f"{param} has {len(documents)} items; at most {MAX_INPUTS} per request.",
                       param=param)
    tokenizer = async_engine.tokenizer
    if config.scorer == "classifier":
        prompts = await async_engine.prepare(pair_prompts, tokenizer, queries, documents)
        pooling = PoolingParams("cls", normalize=False, logit_token_ids=(0,))
        outputs = await _pool_all(async_engine, prompts, pooling, param)
        return [classifier_score(o.pooled, config.sigmoid) for o in outputs], _usage(outputs)
    texts = [rerank_prompt(q, d, instruction) for q, d in zip(queries, documents, strict=True)]
    prompts = await async_engine.prepare(_tokenize, tokenizer, texts)
    pooling = PoolingParams("last", normalize=False, logit_token_ids=yes_no_token_ids(tokenizer))
    outputs = await _pool_all(async_engine, prompts, pooling, param)
    return [relevance(o.pooled) for o in outputs], _usage(outputs)


def _score_pairs(text_1: str | list[str], text_2: str | list[str]) -> tuple[list[str], list[str]]:
    """vLLM's pairing: one text_1 against each text_2, or the lists pairwise."""
    seconds = [text_2] if isinstance(text_2, str) else text_2
    if not seconds:
        raise APIError("text_2 is empty: send at least one text.", param="text_2")
    if isinstance(text_1, str):
        return [text_1] * len(seconds), seconds
    if len(text_1) != len(seconds):
        raise APIError(f"text_1 has {len(text_1)} texts and text_2 {len(seconds)}: send one "
                       "text_1 or as many as text_2.", param="text_1")
    return list(text_1), seconds


def _tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(text) for text in texts]


async def _pool_all(async_engine: AsyncEngine, prompts: list[list[int]],
                    pooling: PoolingParams, param: str) -> list[RequestOutput]:
    """Each prompt's pooled output, all queued at once so they share steps."""
    for ids in prompts:
        _check_length(len(ids), async_engine.max_model_len, param)
    base = uuid.uuid4().hex
    return await asyncio.gather(*(_pool_one(async_engine, ids, pooling, f"pool-{base}-{i}")
                                  for i, ids in enumerate(prompts)))


async def _pool_one(async_engine: AsyncEngine, ids: list[int], pooling: PoolingParams,
                    request_id: str) -> RequestOutput:
    last = None
    try:
        async for output in async_engine.generate(ids, _NO_SAMPLING, request_id,
                                                  pooling=pooling):
            if output.finished:
                last = output
    except PoolingRefused as exc:  # e.g. dimensions past the model's
        raise APIError(str(exc), param=exc.param) from exc
    except ValueError as exc:  # the engine refused it
        raise APIError(str(exc)) from exc
    if last is None or last.pooled is None:
        raise APIError("The request was aborted before it pooled.", status_code=503)
    return last


def _check_length(num_tokens: int, max_model_len: int, param: str) -> None:
    """A prompt that pools may fill the context (it generates nothing), not go past it."""
    if num_tokens > max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens, but an "
                       f"input has {num_tokens} tokens; shorten the {param}.", param=param,
                       code="context_length_exceeded")


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """As OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _usage(outputs: list[RequestOutput]) -> PoolingUsage:
    tokens = sum(o.num_prompt_tokens for o in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
