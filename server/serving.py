"""The chat and completions endpoints: request → prompt ids → engine → response or stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import Request

from scheduler.request import FinishReason
from server import generation
from server.async_engine import AsyncEngine
from server.errors import APIError
from server.generation import Choices
from server.prompts import (
    chat_prompt_ids,
    check_context,
    check_token_ids,
    completion_prompt_ids,
)
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Usage,
)

# Sent instead of a body when the client left before its non-streaming answer was ready.
_CLIENT_CLOSED = 499
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class Serving:
    engine: AsyncEngine
    model_name: str
    max_n: int  # most choices one request may ask for

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        prompt_ids = chat_prompt_ids(self.engine.tokenizer, body.messages)
        return await self._serve(
            body, request, prompt_ids, "messages", "chatcmpl", self._chat_events, self._chat
        )

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        prompt_ids = completion_prompt_ids(self.engine.tokenizer, body.prompt)
        return await self._serve(
            body, request, prompt_ids, "prompt", "cmpl", self._completion_events, self._completion
        )

    async def _serve(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        request: Request,
        prompt_ids: list[int],
        prompt_param: str,
        id_prefix: str,
        events: Callable[[str, Choices, int, bool], AsyncIterator[str]],
        respond: Callable[[str, generation.Result], BaseModel],
    ) -> Response:
        self._check_n(body.n)
        max_tokens = check_context(
            len(prompt_ids), body.requested_max_tokens(), self.engine.max_model_len, prompt_param
        )
        params = body.sampling_params(max_tokens)
        check_token_ids(self.engine.tokenizer, (t for t, _ in params.logit_bias), "logit_bias")
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        start = generation.start(
            self.engine, prompt_ids, params, request_id, body.n, body.priority
        )
        choices = await generation.unless_disconnected(request, start)
        if choices is None:
            return Response(status_code=_CLIENT_CLOSED)
        if body.stream:
            return StreamingResponse(
                events(request_id, choices, body.n, body.include_usage),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        collect = generation.collect(choices, body.n)
        result = await generation.unless_disconnected(request, collect)
        if result is None:
            return Response(status_code=_CLIENT_CLOSED)
        return JSONResponse(respond(request_id, result).model_dump())

    def _check_n(self, n: int) -> None:
        if n > self.max_n:
            raise APIError(
                f"n is {n} but this server returns at most {self.max_n} choices per request; "
                "lower n (or start the server with a higher --max-n).",
                param="n",
            )

    def _chat(self, request_id: str, result: generation.Result) -> ChatCompletion:
        return ChatCompletion(
            id=request_id,
            model=self.model_name,
            choices=[
                ChatChoice(
                    index=c.index,
                    message=AssistantMessage(content=c.text),
                    finish_reason=c.finish_reason,
                )
                for c in result.choices
            ],
            usage=result.usage,
        )

    def _completion(self, request_id: str, result: generation.Result) -> Completion:
        return Completion(
            id=request_id,
            model=self.model_name,
            choices=[
                CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason)
                for c in result.choices
            ],
            usage=result.usage,
        )

    def _chat_events(
        self, request_id: str, choices: Choices, n: int, include_usage: bool
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(items: list[ChatChunkChoice], usage: Usage | None = None) -> BaseModel:
            return ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=items, usage=usage
            )

        def one(index: int, delta: ChatDelta, finish: FinishReason | None = None) -> BaseModel:
            return chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=finish)])

        return generation.sse_stream(
            choices,
            n,
            chunk=lambda index, text, finish: one(index, ChatDelta(content=text or None), finish),
            usage_chunk=(lambda usage: chunk([], usage)) if include_usage else None,
            head=lambda index: one(index, ChatDelta(role="assistant", content="")),
        )

    def _completion_events(
        self, request_id: str, choices: Choices, n: int, include_usage: bool
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(items: list[CompletionChoice], usage: Usage | None = None) -> BaseModel:
            return Completion(
                id=request_id, created=created, model=self.model_name, choices=items, usage=usage
            )

        return generation.sse_stream(
            choices,
            n,
            chunk=lambda index, text, finish: chunk(
                [CompletionChoice(index=index, text=text, finish_reason=finish)]
            ),
            usage_chunk=(lambda usage: chunk([], usage)) if include_usage else None,
        )
