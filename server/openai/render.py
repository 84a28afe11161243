"""vLLM's render routes: a request's prompt token ids, without generating.

`POST /v1/chat/completions/render` and `/v1/completions/render` (and the Responses API's
`/v1/responses/render`, in server.responses.api) take the body of their generating route and
answer `{"token_ids": [...]}` (completions: one such object per prompt). A prefix-aware
router (vllm-router's `cache_aware` policy) renders each request on the replicas to learn which
one already holds its prefix; the ids are exactly those the generating route would schedule, so
its prefix matches are the replica's cache hits.
"""

from __future__ import annotations

from fastapi import APIRouter

from server.async_engine import AsyncEngine
from server.core.chat_format import render_ids
from server.core.chat_request import ChatCompletionRequest
from server.core.prompt_ids import completion_prompts_ids
from server.http.limits import check_request_limits
from server.openai.protocol import CompletionRequest


def render_router(engine: AsyncEngine, tool_call_parser: str | None = None) -> APIRouter:
    """The routes; `tool_call_parser` as the generating routes use it."""
    router = APIRouter()
    tokenizer = engine.tokenizer

    @router.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict:
        check_request_limits(body)
        return {"token_ids": await render_ids(engine, body, tool_call_parser)}

    @router.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict]:
        prompts = body.prompts()
        ids = await engine.prepare(completion_prompts_ids, tokenizer, prompts,
                                   engine.max_prompt_bytes)
        return [{"token_ids": prompt_ids} for prompt_ids in ids]

    return router
