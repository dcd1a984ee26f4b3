"""The OpenAI-compatible HTTP app: routes, API-key check, body-size limit, errors, streaming.

One request's path: the route validates the body (pydantic), turns it into prompt token ids
and `SamplingParams`, then iterates `AsyncLLM.generate`. Streaming responses are server-sent
events ending with `data: [DONE]`. A client that goes away closes the engine iterator, which
aborts the request and frees its KV blocks within an iteration.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastserve.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineShutdownError,
    QueueFullError,
)
from fastserve.model.tokenizer import check_encodable
from fastserve.request import InvalidRequestError, RequestOutput, SamplingParams
from fastserve.server.metrics import CONTENT_TYPE, ServerMetrics
from fastserve.server.schemas import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    FinishReason,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
    now_s,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_S = 1  # what a 429 tells the client to wait before retrying
DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
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
) -> FastAPI:
    """The FastAPI app serving `llm` under `served_model_name`.

    With `api_key`, every `/v1` path needs `Authorization: Bearer <api_key>` (401). Bodies
    over `max_body_bytes` are refused with 413. Both are checked before the body is parsed.
    """
    app = FastAPI(
        title="fastserve",
        summary="OpenAI-compatible LLM serving with skip-join MLFQ scheduling",
        version="0.1.0",
    )
    metrics = ServerMetrics(llm)
    serving = OpenAIServing(llm, served_model_name, metrics)
    app.state.serving = serving
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)
    _add_error_handlers(app, metrics)

    @app.get("/health", responses={503: _ERROR_RESPONSES[503]})
    async def health() -> dict[str, str]:
        """200 while the engine runs, 503 once it has died or shut down."""
        if not llm.is_healthy:
            raise APIError(503, f"engine is not running: {llm.dead_reason}", "server_error", code="engine_dead")
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        """Prometheus text format."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    v1 = APIRouter(prefix="/v1")  # NOTE: RequestGate checks the API key before any parsing

    @v1.get("/models", responses=_ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=[serving.model_card()])

    @v1.get("/models/{model_id:path}", responses=_ERROR_RESPONSES)
    async def get_model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return serving.model_card()

    @v1.post("/completions", response_model=CompletionResponse, responses=_stream_responses())
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        """Complete a prompt (a string or token ids); `stream: true` sends server-sent events."""
        return await serving.completion(body, request)

    @v1.post(
        "/chat/completions", response_model=ChatCompletionResponse, responses=_stream_responses()
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        """Answer a conversation, rendered with the model's chat template."""
        return await serving.chat(body, request)

    app.include_router(v1)
    _narrow_openapi(app, served_model_name, llm.engine.arch.vocab_size, serving.max_model_len)
    return app


def _narrow_openapi(app: FastAPI, model_name: str, vocab_size: int, max_model_len: int) -> None:
    """Write the served model's limits into the OpenAPI document, so a request valid by the
    schema is one the server accepts: its name, its token ids, its context.

    NOTE: one limit is across fields and has no JSON Schema: the prompt's tokens plus
    max_tokens must fit the context (and min_tokens <= max_tokens); those get a 400.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build()
        for param in doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
            param["schema"]["enum"] = [model_name]  # the one model there is; others are 404
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            props = doc["components"]["schemas"][name]["properties"]
            props["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
            for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
                if field in props:
                    _set_maximum(props[field], max_model_len - 1)
            _set_maximum(props["stop_token_ids"], vocab_size - 1)
            if "prompt" in props:
                _set_maximum(props["prompt"], vocab_size - 1)
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


# -- generation -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """One validated generation request, ready for the engine."""

    request_id: str  # the engine's: unique while the request runs
    response_id: str  # the response `id`: the client's `request_id` when it sent one
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage in every chunk (vLLM's continuous_usage_stats)
    created: int


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


class OpenAIServing:
    """The `/v1` handlers' logic, shared by completions and chat completions."""

    def __init__(self, llm: AsyncLLM, served_model_name: str, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.model_name = served_model_name
        self.metrics = metrics
        self.max_model_len: int = llm.engine.max_model_len
        self.created = now_s()

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    # -- endpoints ------------------------------------------------------------------------

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        prompt = body.prompt
        ids = await self._encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        max_tokens = self._max_tokens(
            "max_tokens", body.max_tokens, len(ids), DEFAULT_COMPLETION_MAX_TOKENS, "prompt"
        )
        job = self._job("cmpl", body, ids, max_tokens)
        first, outputs = await self._start(job, request, "prompt")
        if job.stream:
            return _sse(self._completion_events(job, first, outputs))
        final = await _race_disconnect(request, _last(first, outputs))
        return JSONResponse(
            CompletionResponse(
                id=job.response_id,
                created=job.created,
                model=self.model_name,
                choices=[
                    CompletionChoice(text=final.text, finish_reason=_finish_reason(final))
                ],
                usage=_usage(job, final),
            ).model_dump()
        )

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        messages = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
            for m in body.messages
        ]
        kwargs = body.chat_template_kwargs or {}
        render = functools.partial(
            self.llm.tokenizer.apply_chat_template, messages, add_generation_prompt=True, **kwargs)
        try:
            text = await _off_loop(render, sum(len(m["content"]) for m in messages))
        except Exception as exc:  # a template may reject a conversation (e.g. role order)
            raise APIError(400, f"messages: the chat template failed: {exc}", param="messages") from exc
        ids = await self._encode(text, "messages")
        field, requested = body.requested_max_tokens
        max_tokens = self._max_tokens(field, requested, len(ids), None, "messages")
        job = self._job("chatcmpl", body, ids, max_tokens)
        first, outputs = await self._start(job, request, "messages")
        if job.stream:
            return _sse(self._chat_events(job, first, outputs))
        final = await _race_disconnect(request, _last(first, outputs))
        return JSONResponse(
            ChatCompletionResponse(
                id=job.response_id,
                created=job.created,
                model=self.model_name,
                choices=[
                    ChatChoice(
                        message=ChatResponseMessage(content=final.text),
                        finish_reason=_finish_reason(final),
                    )
                ],
                usage=_usage(job, final),
            ).model_dump()
        )

    # -- validation -----------------------------------------------------------------------

    async def _encode(self, text: str, param: str) -> list[int]:
        if not text:
            raise APIError(400, f"{param}: must not be empty", param=param)

        def encode() -> list[int]:
            return list(self.llm.tokenizer.encode(check_encodable(text, param)))

        try:
            return await _off_loop(encode, len(text))
        except InvalidRequestError as exc:
            raise _bad_input(exc, param) from exc

    def _max_tokens(
        self, field: str, requested: int | None, num_prompt: int, default: int | None, prompt_param: str
    ) -> int:
        """The request's output budget; refuses a prompt or budget beyond the model's context."""
        limit = self.max_model_len
        if num_prompt == 0:
            raise APIError(400, f"{prompt_param}: must not be empty", param=prompt_param)
        if num_prompt >= limit:
            raise APIError(
                400,
                f"{prompt_param}: the prompt has {num_prompt} tokens but the model's maximum "
                f"context length is {limit} tokens (and at least one must be left to generate)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = limit - num_prompt
        if requested is None:
            return room if default is None else min(default, room)
        if requested < 1:
            raise APIError(400, f"{field}: must be at least 1, got {requested}", param=field)
        if requested > room:
            raise APIError(
                400,
                f"{field}: {requested} tokens plus the prompt's {num_prompt} exceed the model's "
                f"maximum context length of {limit} tokens; ask for at most {room}",
                param=field,
                code="context_length_exceeded",
            )
        return requested

    def _job(
        self, prefix: str, body: CompletionRequest | ChatCompletionRequest, ids: list[int], max_tokens: int
    ) -> _Job:
        if body.stream_options is not None and not body.stream:
            raise APIError(
                400, "stream_options: only allowed when stream is true", param="stream_options"
            )
        try:
            params = body.sampling_params(max_tokens)
        except ValueError as exc:
            raise _bad_input(exc, "prompt") from exc
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        return _Job(
            request_id=request_id,
            response_id=request_id if body.request_id is None else f"{prefix}-{body.request_id}",
            prompt_token_ids=ids,
            params=params,
            stream=bool(body.stream),
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            created=now_s(),
        )

    # -- engine ---------------------------------------------------------------------------

    async def _start(
        self, job: _Job, request: Request, prompt_param: str
    ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Submit the job and wait for its first output, so errors still get a status code.

        NOTE: the response is not started before the engine has accepted the request, so a
        full queue is a 429 and bad input a 400 rather than an error event mid-stream.
        """
        outputs = self.llm.generate(
            job.prompt_token_ids, job.params, request_id=job.response_id, coalesce=True
        )
        try:
            first = await _race_disconnect(request, anext(outputs))
        except ClientDisconnected:
            raise
        except QueueFullError as exc:
            raise APIError(
                429,
                f"the server is overloaded: {exc}; retry after {RETRY_AFTER_S} s",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from exc
        except EngineDeadError as exc:
            raise _engine_dead(exc) from exc
        except ValueError as exc:
            raise _bad_input(exc, prompt_param) from exc
        if first.finish_reason in ("error", "abort"):  # failed before any token: still a status
            raise _engine_failure(first)
        return first, outputs

    async def _completion_events(
        self, job: _Job, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncGenerator[str, None]:
        exclude = None if job.include_usage else {"usage"}

        def chunk(text: str | None, finish: FinishReason | None = None, usage: Usage | None = None) -> str:
            choices = [] if text is None else [CompletionChoice(text=text, finish_reason=finish)]
            resp = CompletionResponse(
                id=job.response_id, created=job.created, model=self.model_name, choices=choices, usage=usage
            )
            return _data(resp.model_dump(exclude=exclude))

        text_chunk = _TextChunk(chunk(_SLOT))
        async for out in _stream(first, outputs):
            if isinstance(out, APIError):
                yield _data(out.response_body())
                break
            so_far = _usage(job, out) if job.continuous_usage else None
            if out.finished:
                yield chunk(out.new_text, _finish_reason(out), so_far)
                if job.include_usage:
                    yield chunk(None, usage=_usage(job, out))
            elif so_far is not None:
                yield chunk(out.new_text, usage=so_far)  # a chunk per output, text or not
            elif out.new_text:
                yield text_chunk(out.new_text)
        yield "data: [DONE]\n\n"

    async def _chat_events(
        self, job: _Job, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncGenerator[str, None]:
        exclude = None if job.include_usage else {"usage"}

        def chunk(
            delta: ChatDelta | None, finish: FinishReason | None = None, usage: Usage | None = None
        ) -> str:
            choices = [] if delta is None else [ChatChunkChoice(delta=delta, finish_reason=finish)]
            resp = ChatCompletionChunk(
                id=job.response_id, created=job.created, model=self.model_name, choices=choices, usage=usage
            )
            return _data(resp.model_dump(exclude=exclude))

        text_chunk = _TextChunk(chunk(ChatDelta(content=_SLOT)))
        yield chunk(ChatDelta(role="assistant", content=""),
                    usage=_usage(job, None) if job.continuous_usage else None)
        async for out in _stream(first, outputs):
            if isinstance(out, APIError):
                yield _data(out.response_body())
                break
            so_far = _usage(job, out) if job.continuous_usage else None
            if so_far is not None and (out.new_text or not out.finished):
                yield chunk(ChatDelta(content=out.new_text), usage=so_far)
            elif out.new_text:
                yield text_chunk(out.new_text)
            if out.finished:
                yield chunk(ChatDelta(), _finish_reason(out), so_far)
                if job.include_usage:
                    yield chunk(None, usage=_usage(job, out))
        yield "data: [DONE]\n\n"


# -- helpers --------------------------------------------------------------------------------

# Texts longer than this are tokenized (and chat templates rendered) on a worker thread: a
# 1 MiB prompt takes about a second, which would stall every other request and /health. Below
# it the thread hop would cost more than the work.
INLINE_TEXT_CHARS = 4096


async def _off_loop(work: Callable[[], T], num_chars: int) -> T:
    """`work()`, on a worker thread when its input is large (the tokenizer releases the GIL)."""
    if num_chars <= INLINE_TEXT_CHARS:
        return work()
    return await asyncio.to_thread(work)



def _stream_responses() -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "description": "the result, or with `stream: true` server-sent events (`data: {chunk}`"
            " lines ending with `data: [DONE]`)",
            "content": {"text/event-stream": {}},
        },
        **_ERROR_RESPONSES,
    }


def _data(payload: dict[str, Any]) -> str:
    return f"data: {_json(payload)}\n\n"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


_SLOT = "\x00text\x00"  # stands for the text in a chunk rendered once per stream


class _TextChunk:
    """A stream's text chunk as two fixed halves around the text: one `json.dumps` per token.

    NOTE: built by rendering the real pydantic chunk once, so the shape cannot drift from it;
    per token, validating and dumping a model would cost more than the model's decode step.
    """

    def __init__(self, rendered: str) -> None:
        self.head, self.tail = rendered.split(_json(_SLOT))

    def __call__(self, text: str) -> str:
        return self.head + _json(text) + self.tail


def _usage(job: _Job, out: RequestOutput | None) -> Usage:
    """The request's token counts; `out` None: before any output."""
    num_prompt = len(job.prompt_token_ids)
    num_out = 0 if out is None else len(out.token_ids)
    cached = 0 if out is None else out.num_cached_tokens
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_out, total_tokens=num_prompt + num_out,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _finish_reason(out: RequestOutput) -> FinishReason:
    return "length" if out.finish_reason == "length" else "stop"


def _engine_failure(out: RequestOutput) -> APIError:
    if out.finish_reason == "abort":
        return APIError(500, "the request was aborted by the server", "server_error", code="aborted")
    return APIError(500, f"the engine failed this request: {out.error}", "server_error", code="engine_error")


def _bad_input(exc: ValueError, prompt_param: str) -> APIError:
    """A 400 for the engine's ValueError; an InvalidRequestError names its field."""
    param = exc.param if isinstance(exc, InvalidRequestError) else None
    if param == "prompt":
        param = prompt_param
    return APIError(400, str(exc), param=param)


async def _stream(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput | APIError]:
    """The request's outputs, then an APIError if the engine failed it (and nothing after).

    NOTE: closing this generator closes `rest`, the engine iterator, which aborts an
    unfinished request; an `async for` left early would not close it by itself.
    """
    try:
        out = first
        while True:
            if out.finish_reason in ("error", "abort"):
                yield _engine_failure(out)
                return
            yield out
            if out.finished:
                return
            try:
                out = await anext(rest)
            except EngineDeadError as exc:
                yield _engine_dead(exc)
                return
            except StopAsyncIteration:
                yield _engine_failure(out)
                return
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def _last(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final output (non-streaming). Raises APIError if the engine failed the request."""
    events = _stream(first, rest)
    try:
        async for out in events:
            if isinstance(out, APIError):
                raise out
            if out.finished:
                return out
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    raise _engine_failure(first)  # unreachable: _stream ends with a finished output or error


def _engine_dead(exc: Exception) -> APIError:
    if isinstance(exc, EngineShutdownError):  # an orderly end: the client may retry elsewhere
        return APIError(503, str(exc), "server_error", code="shutdown")
    return APIError(503, f"engine is not running: {exc}", "server_error", code="engine_dead")


async def _wait_disconnect(request: Request) -> None:
    # NOTE: the body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _race_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine request) if the client goes away."""
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    pending: set[asyncio.Future[Any]] = {task, watcher}
    try:
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (shutdown timeout): take `work` along
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    return task.result()


def _sse(events: AsyncGenerator[str, None]) -> StreamingResponse:
    return _EventStream(events)


class _EventStream(StreamingResponse):
    """A StreamingResponse that always closes its generator (and so the engine request).

    NOTE: Starlette cancels the sending task when the client disconnects but leaves the body
    generator to the garbage collector; closing it here aborts the request at once.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


# -- API key, body limit, errors -------------------------------------------------------------


class RequestGate:
    """ASGI middleware: the API key and the body-size limit, checked before any parsing.

    With `api_key`, every `/v1` path needs `Authorization: Bearer <api_key>` (401 otherwise;
    compared in constant time). Bodies over `max_body_bytes` get 413: the declared
    Content-Length is checked, then what actually arrives is counted (chunked uploads, a lying
    header), buffering at most `max_body_bytes` and replaying it to the app.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.app = app
        self.expected_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected_key is not None and scope["path"].startswith("/v1"):
            denied = self._check_key(headers.get(b"authorization", b""))
            if denied is not None:
                await self._reject(send, denied)
                return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._reject(send, self._too_large())
            return
        buffered: list[Message] = []
        size = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await self._reject(send, self._too_large())
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    def _check_key(self, header: bytes) -> APIError | None:
        assert self.expected_key is not None
        scheme, _, token = header.partition(b" ")
        challenge = {"WWW-Authenticate": "Bearer"}
        if scheme.lower() != b"bearer" or not token.strip():
            return APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                            code="invalid_api_key", headers=challenge)
        if not hmac.compare_digest(token.strip(), self.expected_key):
            return APIError(401, "incorrect API key provided", code="invalid_api_key", headers=challenge)
        return None

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than the limit of {self.max_body_bytes} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )

    async def _reject(self, send: Send, err: APIError) -> None:
        if self.metrics is not None:
            self.metrics.http_errors.labels(str(err.status_code)).inc()
        payload = _json(err.response_body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
        await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


class _ErrorJSON(JSONResponse):
    """An error body as ASCII JSON: a message may quote the client's text, lone surrogates
    included, which UTF-8 cannot encode (that 500 would also drop a keep-alive connection)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        metrics.http_errors.labels(str(exc.status_code)).inc()
        return _ErrorJSON(exc.response_body(), exc.status_code, headers=exc.headers)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        err = _validation_api_error(exc)
        content_type = request.headers.get("content-type", "")
        if err.info.param is None and "json" not in content_type:
            err.info.message += f" (Content-Type is {content_type or 'missing'!r}: send application/json)"
        return await api_error(request, err)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        err = APIError(exc.status_code, message, code=None, headers=dict(exc.headers or {}))
        return await api_error(request, err)

    async def client_gone(_: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}", "server_error")
        return await api_error(request, err)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientDisconnected, client_gone)
    app.add_exception_handler(Exception, internal_error)


def _validation_api_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 whose message starts with the field's name."""
    err = exc.errors()[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        reason = (err.get("ctx") or {}).get("error", err.get("msg", ""))
        where = f" at character {loc[0]}" if loc else ""
        return APIError(400, f"the request body is not valid JSON: {reason}{where}")
    param = _param_name(loc)
    if not param:
        if kind == "missing":
            return APIError(400, "the request needs a JSON object body")
        return APIError(400, f"the request body must be a JSON object: {err.get('msg')}")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return APIError(400, f"{param}: this field is required", param=param)
    return APIError(400, f"{param}: {err.get('msg')}", param=param)


def _param_name(loc: list[Any]) -> str:
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += f".{part}" if name else str(part)
    return name
