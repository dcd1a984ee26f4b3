"""The OpenAI-compatible HTTP app: its routes (one function each, below), the OpenAPI document.

One request's path: `gate.RequestGate` checks the API key and the body size before any
parsing; the route validates the body (pydantic, `schemas.py`) and hands it to `OpenAIServing`
(`serving.py`), which turns it into prompt token ids and `SamplingParams` and iterates
`AsyncLLM.generate`; `streaming.py` sends server-sent events ending with `data: [DONE]`, and
`gate.py` maps every error to an OpenAI error body naming its `param`. The Responses API
(`responses.py`) runs on the chat path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import Response

from fastserve.engine.async_llm import AsyncLLM
from fastserve.server import reasoning, replies, schemas, tools
from fastserve.server.gate import (
    DEFAULT_MAX_BODY_BYTES,
    RequestGate,
    add_error_handlers,
)
from fastserve.server.lora_admin import lora_router
from fastserve.server.metrics import CONTENT_TYPE, ServerMetrics
from fastserve.server.response_store import ResponseStore
from fastserve.server.responses import ResponsesServing
from fastserve.server.responses_schemas import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from fastserve.server.serving import OpenAIServing
from fastserve.server.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizeServing,
)

logger = logging.getLogger(__name__)
DEFAULT_RESPONSES_STORE_MIB = 64.0

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.ErrorResponse, "description": text}
    for code, text in (
        (400, "bad input; `param` names the field"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "request body too large"),
        (429, "queue full; retry after `Retry-After` seconds"),
        (500, "the engine failed this request"),
        (503, "the engine is not running"),
    )
}


def build_app(
    llm: AsyncLLM,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    tool_call_parser: str = tools.AUTO,
    responses_store_mib: float = DEFAULT_RESPONSES_STORE_MIB,
    reasoning_parser: str = "auto",
    trust_request_chat_template: bool = False,
    metrics_require_key: bool = False,
) -> FastAPI:
    """The FastAPI app serving `llm` under `served_model_name`.

    With `api_key`, every `/v1` path needs `Authorization: Bearer <api_key>` (401). Bodies
    over `max_body_bytes` are refused with 413. Both are checked before the body is parsed.
    `tool_call_parser`: the format of the model's tool calls (`tools.FORMATS`), or "auto"
    (read off its chat template). `responses_store_mib`: the memory stored responses may take
    (0: none are stored). `reasoning_parser`: whether chat outputs are split into thinking and
    answer (`reasoning.NAMES`; "auto": when the chat template has `<think>` blocks).
    `trust_request_chat_template`: chat requests may bring their own chat template.
    `metrics_require_key`: `/metrics`, `/docs`, `/redoc` and `/openapi.json` need the key too.
    """
    tool_format, why = tools.choose(tool_call_parser, llm.tokenizer.chat_template)
    logger.info("tool calls: the %s format (%s)", tool_format.name, why)
    thinks, why = reasoning.choose(reasoning_parser, llm.tokenizer.chat_template)
    logger.info("reasoning: %s (%s)", "<think> blocks are split from the answer" if thinks
                else "not split", why)
    app = FastAPI(
        title="fastserve",
        summary="OpenAI-compatible LLM serving with skip-join MLFQ scheduling",
        version="0.1.0",
    )
    metrics = ServerMetrics(llm)
    serving = OpenAIServing(llm, served_model_name, metrics, tool_format, thinks,
                            trust_request_chat_template)
    app.state.serving = serving
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics,
                       keyed_docs=metrics_require_key)
    add_error_handlers(app, metrics)

    @app.get("/health", responses={503: _ERROR_RESPONSES[503]})
    async def health() -> dict[str, str]:
        """200 while the engine runs; 503 once it has died, while its loop has made no progress
        for `--engine-stall-timeout-s` (code `engine_stalled`), and from the start of a
        shutdown (code `shutdown`: running requests drain, new ones are refused; route
        elsewhere)."""
        if not llm.is_healthy:
            raise schemas.APIError(503, f"engine is not running: {llm.dead_reason}", "server_error", code="engine_dead")
        if llm.is_stalled:
            raise schemas.APIError(
                503, f"the engine loop has made no progress for {llm.seconds_since_progress:.0f} s "
                f"(--engine-stall-timeout-s {llm.config.limits.engine_stall_timeout_s:g})",
                "server_error", code="engine_stalled")
        if llm.is_draining:
            raise schemas.APIError(503, "the server is shutting down: running requests are draining",
                                   "server_error", code="shutdown")
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        """Prometheus text format."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    v1 = APIRouter(prefix="/v1")  # NOTE: RequestGate checks the API key before any parsing

    @v1.get("/models", responses=_ERROR_RESPONSES)
    async def list_models() -> replies.ModelList:
        return replies.ModelList(data=serving.model_cards())

    @v1.get("/models/{model_id:path}", responses=_ERROR_RESPONSES)
    async def get_model(model_id: str) -> replies.ModelCard:
        serving.check_model(model_id)
        return next(card for card in serving.model_cards() if card.id == model_id)

    @v1.post("/completions", response_model=replies.CompletionResponse, responses=_stream_responses())
    async def create_completion(body: schemas.CompletionRequest, request: Request) -> Response:
        """Complete a prompt (a string or token ids); `stream: true` sends server-sent events."""
        return await serving.completion(body, request)

    @v1.post(
        "/chat/completions", response_model=replies.ChatCompletionResponse, responses=_stream_responses()
    )
    async def create_chat_completion(body: schemas.ChatCompletionRequest, request: Request) -> Response:
        """Answer a conversation, rendered with the model's chat template."""
        return await serving.chat(body, request)

    responses = ResponsesServing(serving, ResponseStore(int(responses_store_mib * (1 << 20))))

    @v1.post("/responses", response_model=ResponseObject, responses=_stream_responses(
        "typed server-sent events (`event: <type>` and `data: {event}` lines, from "
        "`response.created` to `response.completed`)"))
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, stateless: the conversation goes whole in `input`."""
        return await responses.create(body, request)

    @v1.get("/responses/{response_id}", response_model=ResponseObject, responses=_stream_responses(
        "a background response's typed server-sent events"))
    async def get_response(response_id: str, stream: bool = False,
                           starting_after: Annotated[int | None, Query(ge=0)] = None) -> Response:
        """A stored response (`store` was not false), or a background one as it is now.
        `stream=true`: a background response's events (after `starting_after`), following
        it while it runs."""
        return responses.get(response_id, stream, starting_after)

    @v1.post("/responses/{response_id}/cancel", responses=_ERROR_RESPONSES)
    async def cancel_response(response_id: str) -> ResponseObject:
        """Stop a background response (status `cancelled`); one that has ended is returned
        as it is."""
        return await responses.cancel(response_id)

    @v1.get("/responses/{response_id}/input_items", responses=_ERROR_RESPONSES)
    async def list_input_items(
        response_id: str, after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> InputItemList:
        """A stored response's own input items, a page at a time (newest first by default)."""
        return responses.input_items(response_id, after, limit, order)

    @v1.delete("/responses/{response_id}", responses=_ERROR_RESPONSES)
    async def delete_response(response_id: str) -> DeletedResponse:
        """Forget a stored response (a response that continues it can no longer be continued)."""
        return await responses.delete(response_id)

    app.include_router(v1)
    tokens = TokenizeServing(serving)

    @app.post("/tokenize", responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's: a prompt's token ids, or a conversation's as the chat endpoint renders it."""
        return await tokens.tokenize(body)

    @app.post("/detokenize", responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's: the text of token ids."""
        return await tokens.detokenize(body)

    def models_changed() -> None:
        app.openapi_schema = None  # rebuilt with the models served now

    app.include_router(lora_router(serving, llm.config.lora.allow_runtime_lora_updating,
                                   models_changed))
    _narrow_openapi(app, lambda: [card.id for card in serving.model_cards()],
                    llm.engine.arch.vocab_size, serving.max_model_len)
    return app


def _narrow_openapi(app: FastAPI, served_models: Callable[[], list[str]], vocab_size: int,
                    max_model_len: int) -> None:
    """Write the served model's limits into the OpenAPI document, so a request valid by the
    schema is one the server accepts: its names (its own, its LoRA adapters' as they are when
    the document is built), its token ids, its context.

    NOTE: one limit is across fields and has no JSON Schema: the prompt's tokens plus
    max_tokens must fit the context (and min_tokens <= max_tokens); those get a 400.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build()
        model_names = served_models()
        for param in doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
            param["schema"]["enum"] = model_names  # the models there are; others are 404
        for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
            props = doc["components"]["schemas"][name]["properties"]
            props["model"] = {"type": "string", "enum": model_names, "title": "Model"}
            for field in ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"):
                if field in props:
                    _set_maximum(props[field], max_model_len - 1)
            for field in ("stop_token_ids", "allowed_token_ids"):
                if field in props:
                    _set_maximum(props[field], vocab_size - 1)
            if "prompt" in props:
                _set_maximum(props["prompt"], vocab_size - 1)
        schemas_ = doc["components"]["schemas"]
        for name in ("TokenizeRequest", "DetokenizeRequest"):
            schemas_[name]["properties"]["model"] = {
                "anyOf": [{"type": "string", "enum": model_names}, {"type": "null"}], "title": "Model"}
        _set_maximum(schemas_["DetokenizeRequest"]["properties"]["tokens"], vocab_size - 1)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _set_maximum(schema: Any, maximum: int) -> None:
    """Bound every integer in `schema` (a JSON Schema, walked through anyOf and items)."""
    if isinstance(schema, list):
        for item in schema:
            _set_maximum(item, maximum)
    elif isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = maximum
        for key in ("anyOf", "items"):
            if key in schema:
                _set_maximum(schema[key], maximum)


def _stream_responses(
    events: str = "server-sent events (`data: {chunk}` lines ending with `data: [DONE]`)",
) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "description": f"the result, or with `stream: true` {events}",
            "content": {"text/event-stream": {}},
        },
        **_ERROR_RESPONSES,
    }
