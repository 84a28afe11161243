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
from server.generation import Outputs
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
        events: Callable[[str, Outputs, bool], AsyncIterator[str]],
        respond: Callable[[str, generation.Result], BaseModel],
    ) -> Response:
        max_tokens = check_context(
            len(prompt_ids), body.requested_max_tokens(), self.engine.max_model_len, prompt_param
        )
        params = body.sampling_params(max_tokens)
        check_token_ids(self.engine.tokenizer, (t for t, _ in params.logit_bias), "logit_bias")
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        start = generation.start(self.engine, prompt_ids, params, request_id)
        outputs = await generation.unless_disconnected(request, start)
        if outputs is None:
            return Response(status_code=_CLIENT_CLOSED)
        if body.stream:
            return StreamingResponse(
                events(request_id, outputs, body.include_usage),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        result = await generation.unless_disconnected(request, generation.collect(outputs))
        if result is None:
            return Response(status_code=_CLIENT_CLOSED)
        return JSONResponse(respond(request_id, result).model_dump())

    def _chat(self, request_id: str, result: generation.Result) -> ChatCompletion:
        message = AssistantMessage(content=result.text)
        return ChatCompletion(
            id=request_id,
            model=self.model_name,
            choices=[ChatChoice(message=message, finish_reason=result.finish_reason)],
            usage=result.usage,
        )

    def _completion(self, request_id: str, result: generation.Result) -> Completion:
        return Completion(
            id=request_id,
            model=self.model_name,
            choices=[CompletionChoice(text=result.text, finish_reason=result.finish_reason)],
            usage=result.usage,
        )

    def _chat_events(
        self, request_id: str, outputs: Outputs, include_usage: bool
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(
            delta: ChatDelta, finish: FinishReason | None = None, usage: Usage | None = None
        ) -> ChatCompletionChunk:
            choices = [] if usage else [ChatChunkChoice(delta=delta, finish_reason=finish)]
            return ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        return generation.sse_stream(
            outputs,
            chunk=lambda text, finish: chunk(ChatDelta(content=text or None), finish),
            usage_chunk=(lambda usage: chunk(ChatDelta(), usage=usage)) if include_usage else None,
            head=chunk(ChatDelta(role="assistant", content="")),
        )

    def _completion_events(
        self, request_id: str, outputs: Outputs, include_usage: bool
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
            return Completion(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        return generation.sse_stream(
            outputs,
            chunk=lambda text, finish: chunk([CompletionChoice(text=text, finish_reason=finish)]),
            usage_chunk=(lambda usage: chunk([], usage)) if include_usage else None,
        )
