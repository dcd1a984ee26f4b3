"""The request gate and the error map: API key and body-size limit checked before any parsing
(`RequestGate`), and every failure turned into an OpenAI error body whose `param` names the
field (taken from `InvalidRequestError.param`, never parsed from a message)."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastserve.engine.async_llm import EngineShutdownError
from fastserve.request import InvalidRequestError, RequestOutput
from fastserve.server.metrics import ServerMetrics
from fastserve.server.schemas import APIError

logger = logging.getLogger(__name__)


DEFAULT_MAX_BODY_BYTES = 1 << 20
# A body declared larger than this gets its 413 on a closing connection. Below it the 413 keeps
# the connection, and the server reads and drops the rest of the body: a client that writes its
# whole body before reading (httpx.AsyncClient, openai.AsyncOpenAI) then gets the 413; closed
# with unread data, the connection would be reset under it.
MAX_DISCARD_BYTES = 64 << 20
# The paths an API key guards: the OpenAI API, and vLLM's tokenizer routes (they run the
# model's tokenizer and chat template for anyone who can reach them).
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")
# What else shows the served models, adapters, vocabulary, context length and the machine
# (`--metrics-require-key` puts them behind the key too): the metrics and the API's documents.
DOC_PATHS = ("/metrics", "/docs", "/redoc", "/openapi.json")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def engine_failure(out: RequestOutput) -> APIError:
    if out.finish_reason == "abort":
        return APIError(500, "the request was aborted by the server", "server_error", code="aborted")
    if out.error_param is not None:  # the request's own input (a grammar too slow to compile)
        return APIError(400, str(out.error), param=out.error_param)
    return APIError(500, f"the engine failed this request: {out.error}", "server_error", code="engine_error")


def bad_input(exc: ValueError, prompt_param: str) -> APIError:
    """A 400 for the engine's ValueError; an InvalidRequestError names its field."""
    param = exc.param if isinstance(exc, InvalidRequestError) else None
    if param == "prompt":
        param = prompt_param
    return APIError(400, str(exc), param=param)


def engine_dead(exc: Exception) -> APIError:
    if isinstance(exc, EngineShutdownError):  # an orderly end: the client may retry elsewhere
        return APIError(503, str(exc), "server_error", code="shutdown")
    return APIError(503, f"engine is not running: {exc}", "server_error", code="engine_dead")


def check_key(given: list[bytes], expected: bytes) -> APIError | None:
    """The error for a request whose Authorization headers (`given`, all of them) do not
    carry `Bearer <expected>`; None when they do. The key is compared in constant time."""
    if len(given) > 1:  # NOTE: which one would count is up to each proxy on the way
        return APIError(400, f"the request has {len(given)} Authorization headers: send "
                        "one, 'Authorization: Bearer <key>'", code="invalid_api_key")
    scheme, _, token = (given[0] if given else b"").partition(b" ")
    challenge = {"WWW-Authenticate": "Bearer"}
    if scheme.lower() != b"bearer" or not token.strip():
        return APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                        code="invalid_api_key", headers=challenge)
    if not hmac.compare_digest(token.strip(), expected):
        return APIError(401, "incorrect API key provided", code="invalid_api_key", headers=challenge)
    return None


class RequestGate:
    """ASGI middleware: the API key and the body-size limit, checked before any parsing.

    With `api_key`, every `/v1` path (and `/tokenize`, `/detokenize`; with `keyed_docs`,
    `/metrics` and the API's documents too) needs `Authorization: Bearer <api_key>` (401
    otherwise, compared in constant time; 400 for two Authorization headers). Bodies over `max_body_bytes` get 413: the declared
    Content-Length is checked, then what actually arrives is counted (chunked uploads, a lying
    header), buffering at most `max_body_bytes` and replaying it to the app.

    NOTE: the 413 goes out before the body has been read; uvicorn drops the rest of the body
    once the response is complete and keeps the connection (below `MAX_DISCARD_BYTES`).
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        metrics: ServerMetrics | None = None,
        keyed_docs: bool = False,
    ) -> None:
        self.app = app
        self.expected_key = api_key.encode() if api_key else None
        self.keyed_paths = KEYED_PATHS + (DOC_PATHS if keyed_docs else ())
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected_key is not None and scope["path"].startswith(self.keyed_paths):
            denied = self._check_key([v for k, v in scope["headers"] if k == b"authorization"])
            if denied is not None:
                await self._reject(send, denied)
                return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            close = not declared.isdigit() or int(declared) > MAX_DISCARD_BYTES
            await self._reject(send, self._too_large(close))
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

    def _check_key(self, given: list[bytes]) -> APIError | None:
        assert self.expected_key is not None
        return check_key(given, self.expected_key)

    def _too_large(self, close: bool = False) -> APIError:
        return APIError(
            413,
            f"the request body is larger than the limit of {self.max_body_bytes} bytes",
            code="request_too_large",
            headers={"Connection": "close"} if close else None,
        )

    async def _reject(self, send: Send, err: APIError) -> None:
        if self.metrics is not None:
            self.metrics.http_errors.labels(str(err.status_code)).inc()
        payload = json.dumps(err.response_body(), separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
        await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


class _ErrorJSON(JSONResponse):
    """An error body as ASCII JSON: a message may quote the client's text, lone surrogates
    included, which UTF-8 cannot encode (that 500 would also drop a keep-alive connection)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
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
    loc = list(err.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path"):  # where the field is: not its name
        loc = loc[1:]
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
