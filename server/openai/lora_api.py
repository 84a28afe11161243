"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`, as vLLM names them: LoRA
adapters loaded and unloaded while the server runs, between the engine's steps. An adapter
the engine refuses (no such file, a rank over --max-lora-rank, another base, a corrupt file,
no free slot) is a 400 saying why; the server goes on serving."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from server.async_engine import AsyncEngine
from server.http.errors import APIError


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)


def lora_router(engine: AsyncEngine, model_ids: list[str]) -> APIRouter:
    """The routes over `engine.adapters`; an adapter may not take a name of the base model
    (`model_ids`), which requests would then no longer reach."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        if body.lora_name in model_ids:
            raise APIError(f"{body.lora_name!r} is the base model's name: give the adapter "
                           "another", param="lora_name")
        try:
            await engine.adapters.load(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise APIError(str(exc)) from exc
        return PlainTextResponse(f"Success: LoRA adapter {body.lora_name!r} added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        try:
            await engine.adapters.unload(body.lora_name)
        except ValueError as exc:
            raise APIError(str(exc)) from exc
        return PlainTextResponse(f"Success: LoRA adapter {body.lora_name!r} removed successfully.")

    return router
