"""vLLM's endpoints that load and unload LoRA adapters while the server runs:
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

They read a path on the server's disk that the client names, so they are served only with
`--allow-runtime-lora-updating` (vLLM: `VLLM_ALLOW_RUNTIME_LORA_UPDATING`); without it they
answer 404 naming the flag, and the OpenAPI document leaves them out. As vLLM's, a success is
a plain-text line; a failure is an OpenAI error body naming `lora_name` or `lora_path`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from fastserve.engine.loras import LoRANotFoundError
from fastserve.model.lora import LoRAError
from fastserve.server.schemas import APIError, ErrorResponse
from fastserve.server.serving import OpenAIServing

_NAME = Field(..., min_length=1, max_length=256,
              description="The name requests give as their `model` to run with the adapter.")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr = _NAME
    lora_path: StrictStr = Field(
        ..., min_length=1, description="A PEFT adapter directory on the server's disk "
        "(adapter_config.json, adapter_model.safetensors).")
    load_inplace: StrictBool = Field(
        False, description="Load an adapter of a name already served again (e.g. a newer "
        "checkpoint): requests from then on run with it, running ones finish with the old.")


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr = _NAME
    lora_int_id: StrictInt | None = Field(
        None, description="vLLM's; ignored: adapters are known by name.")


_DOCS: dict[int | str, dict[str, Any]] = {
    200: {"description": "a line saying what was done", "content": {"text/plain": {}}},
    400: {"model": ErrorResponse, "description": "bad adapter or name; `param` names the field"},
    404: {"model": ErrorResponse, "description": "no adapter of that name is loaded"},
}


def lora_router(serving: OpenAIServing, enabled: bool, on_change: Callable[[], None]) -> APIRouter:
    """The two routes (under /v1). `on_change` runs after an adapter comes or goes (the
    OpenAPI document lists the models served)."""
    router = APIRouter(prefix="/v1")
    llm = serving.llm

    def check_enabled() -> None:
        if not enabled:
            raise APIError(404, "loading and unloading LoRA adapters while serving is off: "
                                "start the server with --allow-runtime-lora-updating",
                           code="runtime_lora_updating_off")

    @router.post("/load_lora_adapter", response_class=PlainTextResponse, responses=_DOCS,
                 include_in_schema=enabled)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Serve the PEFT adapter at `lora_path` as `lora_name` (vLLM's)."""
        check_enabled()
        if body.lora_name == serving.model_name:
            raise APIError(400, f"lora_name: {body.lora_name!r} is the served model's name",
                           param="lora_name")
        try:
            await llm.load_lora(body.lora_name, body.lora_path, replace=body.load_inplace)
        except LoRAError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        on_change()
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=_DOCS,
                 include_in_schema=enabled)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """Stop serving adapter `lora_name`; requests running with it finish (vLLM's)."""
        check_enabled()
        try:
            await llm.unload_lora(body.lora_name)
        except LoRANotFoundError as exc:
            raise APIError(404, str(exc), param="lora_name", code="lora_not_found") from None
        on_change()
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
