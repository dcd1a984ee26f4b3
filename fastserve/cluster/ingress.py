"""The fleet's HTTP ingress: one OpenAI endpoint in front of the engine replicas.

It picks a replica for each HTTP request (`router.ReplicaTable`, from the prompt's
`RouteRequest` and the replicas' latest stats), forwards the request as it came to that
replica's own HTTP server (`proxy.ReplicaClient`), and copies the replica's answer back,
SSE bytes as they come, without decoding them. It parses nothing it does not route by: every
status, error body and stream comes from the replica's own fastserve app. Only `/metrics` is
the ingress's own (`metrics.FleetMetrics`).

Faults (a replica's process dies, or its connection breaks):
- before the replica answered (its first body bytes: a stream's first token, or a whole
  non-streamed body), the request goes to another replica; after `max_attempts` failures it
  is a 503;
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

import aiohttp
from starlette.types import Message, Receive, Scope, Send

from fastserve.cluster.metrics import FleetMetrics
from fastserve.cluster.proxy import ForwardedRequest, ReplicaClient, response_headers
from fastserve.cluster.router import Target
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


class Replicas(Protocol):
    """What the ingress asks of its replicas' table (`router.ReplicaTable`)."""

    def choose(self, route: RouteRequest | None,
               exclude: frozenset[str] = frozenset()) -> Target | None: ...

    def mark_down(self, replica_id: str) -> None: ...

    def forget(self, target: Target) -> None: ...


class _ClientGone(Exception):
    """The client went away: nobody is left to answer."""


# What a replica's failure looks like to the ingress: it refused or dropped the connection.
_REPLICA_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


class FleetIngress:
    """The ASGI app `fastserve serve --replicas N` listens with."""

    def __init__(self, replicas: Replicas, client: ReplicaClient, metrics: FleetMetrics,
                 hints: RouteHints | None, max_body_bytes: int, max_attempts: int,
                 metrics_key: str | None = None) -> None:
        self.replicas = replicas
        self.client = client
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
            method=scope["method"], path=scope["path"], raw_path=scope.get("raw_path") or b"",
            query_string=scope.get("query_string", b""), headers=tuple(scope["headers"]),
            body=body)
        route = await self.hints.route(req.path, body) if self.hints else None
        status = await _Exchange(self, req, route, receive, send).run()
        self.metrics.requests.labels(str(status)).inc()


class _Exchange:
    """One client request through the fleet: attempts until a replica answers, then its
    answer; a client that goes away closes the replica's connection (which aborts the
    request there)."""

    def __init__(self, ingress: FleetIngress, req: ForwardedRequest, route: RouteRequest | None,
                 receive: Receive, send: Send) -> None:
        self.ingress = ingress
        self.req = req
        self.route = route
        self.receive = receive
        self.send = send
        self.resp: aiohttp.ClientResponse | None = None  # the current replica's response
        # The replica the request was sent to, until its engine is known to have taken it in
        # (its answer began with a 2xx); forgotten by the table otherwise.
        self.target: Target | None = None
        self.gone = False
        self.started = False  # the response's start has gone to the client
        self.complete = False  # the replica's answer was read to its end

    async def run(self) -> int:
        watcher = asyncio.create_task(self._watch_disconnect())
        try:
            return await self._run()
        except _ClientGone:
            return 499
        except Exception as exc:  # a failure that is not a replica's death (a bug): a 500
            if self.started or self.gone:
                raise
            logger.exception("forwarding to the replica failed")
            err = APIError(500, f"the fleet failed this request: {type(exc).__name__}: {exc}",
                           "server_error", code="replica_error")
            await _send_whole(self.send, 500, json.dumps(err.response_body()).encode(),
                              "application/json")
            return 500
        finally:
            watcher.cancel()
            if self.target is not None:
                self.ingress.replicas.forget(self.target)
            if self.resp is not None:
                # NOTE: a connection whose answer was not read to its end is closed, not
                # reused: the replica sees its client go and aborts the request.
                if self.complete:
                    self.resp.release()
                else:
                    self.resp.close()

    async def _run(self) -> int:
        m = self.ingress.metrics
        t0 = time.perf_counter()
        first = await self._first_answer()
        if first is None:
            m.unavailable.inc()
            err = APIError(503, "no replica could answer the request (they failed or are "
                           "restarting); retry", "server_error", code="replica_unavailable")
            await _send_whole(self.send, 503, json.dumps(err.response_body()).encode(),
                              "application/json", {"retry-after": "1"})
            return 503
        resp, body = first
        if resp.status < 300 and self.route is not None:
            # NOTE: a replica answers a generation request after its first output, so after
            # its engine took the request in: the replica's count of them says so from now.
            self.target = None
        m.first_byte.observe(time.perf_counter() - t0)
        self.started = True
        await self.send({"type": "http.response.start", "status": resp.status,
                         "headers": response_headers(resp)})
        more = not resp.content.at_eof()
        await self._body(body, more)
        if more:
            await self._rest(resp, _is_event_stream(resp))
        else:
            self.complete = True
        return resp.status

    async def _first_answer(self) -> tuple[aiohttp.ClientResponse, bytes] | None:
        """The chosen replica's response and its first body bytes; a replica that fails
        before them is left out and the request sent to another."""
        tried: set[str] = set()
        for attempt in range(self.ingress.max_attempts):
            if self.gone:
                raise _ClientGone
            target = self.ingress.replicas.choose(self.route, frozenset(tried))
            if target is None and tried:  # every replica failed once: try them again
                tried.clear()
                target = self.ingress.replicas.choose(self.route)
            if target is None:  # none known yet, or all restarting
                await asyncio.sleep(_RETRY_BACKOFF_S * (attempt + 1))
                continue
            self.target = target
            try:
                self.resp = await self.ingress.client.open(target.url, self.req)
                body = await self.resp.content.readany()
                return self.resp, body
            except _REPLICA_ERRORS as exc:
                if self.gone:
                    raise _ClientGone from None
                logger.warning("replica %s failed before answering (attempt %d): %s: %s",
                               target.replica_id, attempt + 1, type(exc).__name__, exc)
                if isinstance(exc, aiohttp.ClientConnectorError):  # not listening: down
                    self.ingress.replicas.mark_down(target.replica_id)
                tried.add(target.replica_id)
                self.ingress.replicas.forget(target)
                self.target = None
                if self.resp is not None:
                    self.resp.close()
                    self.resp = None
                self.ingress.metrics.retries.inc()
                await asyncio.sleep(_RETRY_BACKOFF_S * attempt)
        return None

    async def _rest(self, resp: aiohttp.ClientResponse, is_sse: bool) -> None:
        while True:
            try:
                chunk = await resp.content.readany()
            except _REPLICA_ERRORS as exc:  # the replica died or failed mid-answer
                if self.gone:
                    raise _ClientGone from None
                logger.warning("replica failed mid-answer: %s: %s", type(exc).__name__, exc)
                self.ingress.metrics.replica_failures.inc()
                if is_sse:
                    err = APIError(500, f"the replica serving this request failed: "
                                   f"{type(exc).__name__}", "server_error",
                                   code="replica_failed")
                    await self._body(
                        (sse_data(err.response_body()) + "data: [DONE]\n\n").encode(), True)
                break
            if not chunk:
                self.complete = True
                break
            await self._body(chunk, True)
        if self.gone:
            raise _ClientGone
        await self._body(b"", False)

    async def _body(self, data: bytes, more: bool) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def _watch_disconnect(self) -> None:
        while True:
            msg: Message = await self.receive()
            if msg["type"] == "http.disconnect":
                self.gone = True
                if self.resp is not None:
                    self.resp.close()  # wakes a read waiting on it
                return


def _is_event_stream(resp: aiohttp.ClientResponse) -> bool:
    return resp.content_type == "text/event-stream"


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
