"""The fleet's HTTP ingress: one OpenAI endpoint in front of the engine replicas.

It forwards each HTTP request as it came (`ForwardedRequest`) through the replica
deployment's handle, whose router picks the replica, and streams the replica's answer back.
It parses nothing it does not route by: every status, error body and stream comes from the
replica's own fastserve app. Only `/metrics` is the ingress's own (`metrics.FleetMetrics`).

Faults (a replica's process dies, or Ray finds it unhealthy):
- before the replica answered (its first token, or a whole non-streamed body), the request
  goes to another replica; after `max_attempts` failures it is a 503;
- mid-stream, the stream gets an error event (code `replica_failed`) and `data: [DONE]`.
Nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import RequestCancelledError
from starlette.types import Message, Receive, Scope, Send

from fastserve.cluster.asgi import ForwardedRequest, ResponseStart
from fastserve.cluster.metrics import FleetMetrics
from fastserve.fleet.router import RouteRequest
from fastserve.server.gate import check_key
from fastserve.server.metrics import CONTENT_TYPE
from fastserve.server.responses_schemas import ResponsesRequest
from fastserve.server.schemas import APIError, ChatCompletionRequest
from fastserve.server.streaming import sse_data

logger = logging.getLogger(__name__)

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# Texts longer than this are tokenized on a worker thread (as the server does).
_INLINE_TEXT_CHARS = 4096
_RETRY_BACKOFF_S = 0.2


class Encoder(Protocol):
    """What routing needs of the tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class RouteHints:
    """Builds a request's `RouteRequest` (prompt length, block hashes) from its JSON body, as
    the replicas will tokenize it; None when the body is not a generation request it can read
    (the replica then answers it, or its error)."""

    tokenizer: Encoder
    block_size: int
    # LoRA adapters' names: their requests' cached blocks are hashed with the adapter as salt,
    # which differs between processes, so the router is given their length only (and so for
    # a request with a `cache_salt` of its own).
    lora_names: frozenset[str] = frozenset()

    async def route(self, path: str, body: bytes) -> RouteRequest | None:
        if path not in ROUTED_PATHS:
            return None
        try:
            data = json.loads(body)
            ids = await self._prompt_ids(path, data)
        except Exception:  # unreadable here means unreadable there: the replica says why
            return None
        if not ids:
            return None
        keep = data.get("truncate_prompt_tokens")  # the replica reads only the prompt's end
        if type(keep) is int and 0 < keep < len(ids):  # NOTE: -1 (fit the context) is not mirrored
            ids = ids[:keep] if data.get("truncation_side") == "right" else ids[len(ids) - keep:]
        request_id = f"route-{uuid.uuid4().hex}"
        if data.get("model") in self.lora_names or data.get("cache_salt") is not None:
            return RouteRequest(request_id, len(ids))
        return RouteRequest.from_tokens(request_id, ids, self.block_size)

    async def _prompt_ids(self, path: str, data: Any) -> list[int] | None:
        if path == "/v1/completions":
            prompt = data.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if not isinstance(prompt, str):
                return None
            bos = data.get("add_special_tokens") is not False
            return await _off_loop(lambda: list(self.tokenizer.encode(prompt, bos)), len(prompt))
        chat = (ResponsesRequest.model_validate(data).to_chat() if path == "/v1/responses"
                else ChatCompletionRequest.model_validate(data))
        if chat.chat_template is not None:  # the client's code: the replica decides to run it
            return None
        messages, kwargs = chat.template_args()

        def render() -> list[int]:
            # NOTE: kwargs say how the prompt ends (add_generation_prompt, continue_final_message)
            text = self.tokenizer.apply_chat_template(messages, **kwargs)
            return list(self.tokenizer.encode(text))

        return await _off_loop(render, sum(len(m["content"]) for m in messages))


async def _off_loop(work: Callable[[], list[int]], num_chars: int) -> list[int]:
    if num_chars <= _INLINE_TEXT_CHARS:
        return work()
    return await asyncio.to_thread(work)


class ReplicaHandle(Protocol):
    """The part of Ray Serve's `DeploymentHandle` the ingress uses."""

    def options(self, *, stream: bool, _by_reference: bool) -> Any: ...


class FleetIngress:
    """The ASGI app `fastserve serve --replicas N` listens with."""

    def __init__(self, handle: ReplicaHandle, metrics: FleetMetrics, hints: RouteHints | None,
                 max_body_bytes: int, max_attempts: int, metrics_key: str | None = None) -> None:
        # Ray Serve's gRPC transport between the ingress and the replicas
        # (`_by_reference=False`), not Ray's actor calls: through the latter a replica's first
        # chunk reached the ingress ~5 ms after it was yielded, through gRPC ~1 ms (the
        # fleet's added TTFT went from 10.6-12.1 ms to 5.4-6.8 ms, benchmarks/fleet/fleet_real.py).
        self.stream = handle.options(stream=True, _by_reference=False)
        self.metrics = metrics
        self.hints = hints
        self.max_body_bytes = max_body_bytes
        self.max_attempts = max_attempts
        # `--metrics-require-key`: the key /metrics needs (the replicas' gates guard the rest).
        self.metrics_key = metrics_key.encode() if metrics_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            denied = None if self.metrics_key is None else check_key(
                [v for k, v in scope["headers"] if k == b"authorization"], self.metrics_key)
            if denied is not None:
                body = json.dumps(denied.response_body()).encode()
                await _send_whole(send, denied.status_code, body, "application/json",
                                  denied.headers)
                return
            await _send_whole(send, 200, self.metrics.render(), CONTENT_TYPE)
            return
        body = await _read_body(receive, self.max_body_bytes + 1)  # more is refused (413) there
        req = ForwardedRequest(
            method=scope["method"], path=scope["path"], query_string=scope.get("query_string", b""),
            headers=tuple(scope["headers"]), body=body,
            client=tuple(scope["client"]) if scope.get("client") else None)  # type: ignore[arg-type]
        route = await self.hints.route(req.path, body) if self.hints else None
        status = await _Exchange(self, req, route, receive, send).run()
        self.metrics.requests.labels(str(status)).inc()


class _Exchange:
    """One client request through the fleet: attempts until a replica answers, then its
    stream; a client that goes away cancels the replica's call (which aborts the request)."""

    def __init__(self, ingress: FleetIngress, req: ForwardedRequest, route: RouteRequest | None,
                 receive: Receive, send: Send) -> None:
        self.ingress = ingress
        self.req = req
        self.route = route
        self.receive = receive
        self.send = send
        self.call: Any = None  # the current replica call (a DeploymentResponseGenerator)
        self.gone = False
        self.started = False  # the response's start has gone to the client

    async def run(self) -> int:
        watcher = asyncio.create_task(self._watch_disconnect())
        try:
            return await self._run()
        except RequestCancelledError:
            return 499  # the client went away; nobody is left to answer
        except Exception as exc:  # a replica's failure that is not its death (a bug): a 500
            if self.started:
                raise
            logger.exception("the replica call failed")
            err = APIError(500, f"the fleet failed this request: {type(exc).__name__}: {exc}",
                           "server_error", code="replica_error")
            await _send_whole(self.send, 500, json.dumps(err.response_body()).encode(),
                              "application/json")
            return 500
        finally:
            watcher.cancel()

    async def _run(self) -> int:
        m = self.ingress.metrics
        t0 = time.perf_counter()
        start = await self._first_answer()
        if start is None:
            m.unavailable.inc()
            err = APIError(503, "no replica could answer the request (they failed or are "
                           "restarting); retry", "server_error", code="replica_unavailable")
            await _send_whole(self.send, 503, json.dumps(err.response_body()).encode(),
                              "application/json", {"retry-after": "1"})
            return 503
        m.first_byte.observe(time.perf_counter() - t0)
        self.started = True
        await self.send({"type": "http.response.start", "status": start.status,
                         "headers": list(start.headers)})
        await self._body(start.body, start.more_body)
        if start.more_body:
            await self._rest(_is_event_stream(start.headers))
        return start.status

    async def _first_answer(self) -> ResponseStart | None:
        """The replica's first item; a replica that fails before it is tried again elsewhere."""
        for attempt in range(self.ingress.max_attempts):
            if self.gone:
                raise RequestCancelledError("the client went away")
            self.call = self.ingress.stream.remote(self.req, self.route)
            try:
                first = await self.call.__anext__()
            except (RayActorError, ActorUnavailableError, StopAsyncIteration) as exc:
                logger.warning("replica failed before answering (attempt %d): %s", attempt + 1,
                               type(exc).__name__)
                self.ingress.metrics.retries.inc()
                await asyncio.sleep(_RETRY_BACKOFF_S * attempt)
                continue
            if isinstance(first, ResponseStart):
                return first
            raise TypeError(f"a replica answered {type(first).__name__} before its start")
        return None

    async def _rest(self, is_sse: bool) -> None:
        try:
            async for chunk in self.call:
                await self._body(chunk, True)
        except RequestCancelledError:
            raise
        except Exception as exc:  # the replica died or failed mid-answer
            logger.warning("replica failed mid-answer: %s: %s", type(exc).__name__, exc)
            self.ingress.metrics.replica_failures.inc()
            if is_sse:
                err = APIError(500, f"the replica serving this request failed: "
                               f"{type(exc).__name__}", "server_error", code="replica_failed")
                await self._body((sse_data(err.response_body()) + "data: [DONE]\n\n").encode(),
                                 True)
        await self._body(b"", False)

    async def _body(self, data: bytes, more: bool) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def _watch_disconnect(self) -> None:
        while True:
            msg: Message = await self.receive()
            if msg["type"] == "http.disconnect":
                self.gone = True
                if self.call is not None:
                    self.call.cancel()
                return


def _is_event_stream(headers: tuple[tuple[bytes, bytes], ...]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
               for k, v in headers)


async def _read_body(receive: Receive, limit: int) -> bytes:
    """The request body, at most `limit` bytes of it."""
    parts: list[bytes] = []
    size = 0
    more = True
    while more and size < limit:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunk = msg.get("body", b"")
        parts.append(chunk)
        size += len(chunk)
        more = bool(msg.get("more_body", False))
    return b"".join(parts)[:limit]


async def _send_whole(send: Send, status: int, body: bytes, content_type: str,
                      headers: dict[str, str] | None = None) -> None:
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})

