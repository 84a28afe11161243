"""The chat and completions endpoints: request → prompt ids → engine → response or stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.requests import Request

from server.async_engine import AsyncEngine
from server.core import engine_choices
from server.core.chat_format import prepared_chat
from server.core.chat_request import ChatCompletionRequest, Usage
from server.core.prompt_ids import check_context, check_token_ids, completion_prompts_ids
from server.core.tool_parser_choice import parser_named
from server.http.errors import APIError
from server.http.sse import CLIENT_CLOSED, event_stream
from server.openai.choice_streams import ChatChoiceStream, CompletionChoiceStream
from server.openai.logprobs import LogprobsAligner
from server.openai.protocol import (
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionRequest,
)
from server.serve_args import MAX_N

if TYPE_CHECKING:
    from metal_engine.outputs import RequestOutput
    from scheduler.media import PromptMedia
    from scheduler.sampling_params import SamplingParams, StructuredOutput


class ChoiceStream(Protocol):
    """One choice's outputs as the endpoint's choice objects (see server.openai.choice_streams)."""

    def chunk_choice(self, index: int, output: RequestOutput) -> BaseModel | None: ...

    def whole_choice(self, index: int, outputs: list[RequestOutput]) -> BaseModel: ...


@dataclass(frozen=True)
class _Endpoint:
    """What differs between chat and completions once the prompts are known."""

    id_prefix: str
    prompt_param: str  # the field a too-long prompt is blamed on
    new_stream: Callable[[int], ChoiceStream]  # for choice k
    # The response (whole, or one stream chunk) from id, created, choices and usage.
    response: Callable[[str, int, list[Any], Usage | None], BaseModel]
    head: Callable[[int], BaseModel] | None = None  # a stream's first item for choice k
    # What the prompt's format adds to the params (its ends of a turn, special tokens shown).
    with_format: Callable[[SamplingParams], SamplingParams] | None = None


@dataclass(frozen=True)
class Serving:
    engine: AsyncEngine
    model_name: str
    max_n: int  # most choices one request may ask for
    tool_call_parser: str | None = None  # overrides the one picked from the chat template

    def __post_init__(self) -> None:
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n is {self.max_n}; it must be in [1, {MAX_N}] (OpenAI's n)")
        if self.tool_call_parser is not None:
            parser_named(self.tool_call_parser)  # a ValueError naming the known parsers

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        tokenizer = self.engine.tokenizer
        self._check_count(body.n, 1)
        prepared = await prepared_chat(self.engine, body, self.tool_call_parser,
                                       self.engine.max_prompt_bytes)

        def new_stream(_: int) -> ChatChoiceStream:
            return ChatChoiceStream(
                prepared.new_parser(),
                LogprobsAligner(tokenizer, prepared.ids) if body.logprobs else None,
                body.parallel_tool_calls,
            )

        def response(
            request_id: str, created: int, choices: list[Any], usage: Usage | None
        ) -> BaseModel:
            kind = ChatCompletionChunk if body.stream else ChatCompletion
            return kind(
                id=request_id, created=created, model=self.answering(body.model), choices=choices,
                usage=usage,
            )

        def head(index: int) -> BaseModel:
            return ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))

        endpoint = _Endpoint("chatcmpl", "messages", new_stream, response, head,
                             prepared.with_format)  # fmt: skip
        return await self._serve(body, request, [prepared.ids], prepared.structured, endpoint,
                                 prepared.media)

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        tokenizer = self.engine.tokenizer
        prompts = body.prompts()
        self._check_count(body.n, len(prompts))  # before a single prompt is tokenized
        prompt_ids = await self.engine.prepare(completion_prompts_ids, tokenizer, prompts,
                                               self.engine.max_prompt_bytes)

        def new_stream(k: int) -> CompletionChoiceStream:
            p = k // body.n
            echo = _prompt_text(tokenizer, prompts[p]) if body.echo else ""
            logprobs = body.logprobs is not None
            return CompletionChoiceStream(
                echo, LogprobsAligner(tokenizer, prompt_ids[p]) if logprobs else None
            )

        def response(
            request_id: str, created: int, choices: list[Any], usage: Usage | None
        ) -> BaseModel:
            return Completion(
                id=request_id, created=created, model=self.answering(body.model), choices=choices,
                usage=usage,
            )

        endpoint = _Endpoint("cmpl", "prompt", new_stream, response)
        return await self._serve(body, request, prompt_ids, None, endpoint)

    async def _serve(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        request: Request,
        prompts: list[list[int]],
        structured: StructuredOutput | None,
        endpoint: _Endpoint,
        media: PromptMedia | None = None,
    ) -> Response:
        count = len(prompts) * body.n
        # One SamplingParams serves every prompt, so the longest one bounds max_tokens.
        defaults, context = self.engine.sampling_defaults, self.engine.max_model_len
        requested = defaults.max_tokens(body.requested_max_tokens())
        max_tokens = min(
            check_context(len(ids), requested, context, endpoint.prompt_param) for ids in prompts
        )
        params = body.sampling_params(max_tokens, structured, self.engine.sampling_defaults)
        if endpoint.with_format is not None:
            params = endpoint.with_format(params)
        check_token_ids(self.engine.tokenizer, (t for t, _ in params.logit_bias), "logit_bias")
        request_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        start = engine_choices.start_prompts(
            self.engine, prompts, params, request_id, body.n, body.priority, body.cache_salt,
            media, self.engine.adapters.lora_name(body.model),
        )
        choices = await engine_choices.unless_disconnected(request, start)
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)
        streams = [endpoint.new_stream(k) for k in range(count)]
        if body.stream:
            return event_stream(self._events(endpoint, request_id, choices, streams, body))
        collect = engine_choices.collect(choices, count)
        outputs = await engine_choices.unless_disconnected(request, collect)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        whole = [stream.whole_choice(k, outputs[k]) for k, stream in enumerate(streams)]
        usage = engine_choices.usage_of([choice_outputs[-1] for choice_outputs in outputs], body.n)
        return JSONResponse(
            endpoint.response(request_id, int(time.time()), whole, usage).model_dump()
        )

    def answering(self, model: str | None) -> str:
        """The model name a response gives: the LoRA adapter `model` names, else the base's."""
        return self.engine.adapters.lora_name(model) or self.model_name

    def _check_count(self, n: int, num_prompts: int) -> None:
        if n * num_prompts > self.max_n:
            prompts = f" for each of {num_prompts} prompts" if num_prompts > 1 else ""
            raise APIError(
                f"n is {n}{prompts} but this server returns at most {self.max_n} choices per "
                "request; lower n, send fewer prompts (or start the server with a higher "
                "--max-n).",
                param="n",
            )

    def _events(
        self,
        endpoint: _Endpoint,
        request_id: str,
        choices: engine_choices.Choices,
        streams: list[ChoiceStream],
        body: ChatCompletionRequest | CompletionRequest,
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(items: list[Any], usage: Usage | None = None) -> BaseModel:
            return endpoint.response(request_id, created, items, usage)

        def one(index: int, output: RequestOutput) -> BaseModel | None:
            item = streams[index].chunk_choice(index, output)
            return None if item is None else chunk([item])

        head = endpoint.head
        return engine_choices.sse_stream(
            choices,
            len(streams),
            body.n,
            one,
            usage_chunk=(lambda usage: chunk([], usage)) if body.include_usage else None,
            head=(lambda index: chunk([head(index)])) if head is not None else None,
        )


def _prompt_text(tokenizer: Any, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
