"""One HTTP request carried from the fleet's ingress to a replica, and run there through the
replica's own fastserve app in-process (an ASGI call, no socket).

Each replica serves exactly the single server's app (`fastserve.server.app.build_app`), so a
fleet answers with the same options, validation, errors and streams as one server. The ingress
reads the client's request into a `ForwardedRequest`; the replica's `run_app` yields the
response as a `ResponseStart` (status and headers) followed by body bytes. No Ray here: this
module is plain asyncio, so it is tested without a cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class ForwardedRequest:
    """What the replica's app needs of the client's request (pickled across Ray)."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # raw, lower-case names as the client sent them
    body: bytes
    client: tuple[str, int] | None = None  # the client's address, for the access log


@dataclass(frozen=True)
class ResponseStart:
    """The response's status line and headers; always the first item `run_app` yields."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    # NOTE: the start travels together with the first body bytes (or the whole body), so an
    # ingress that has received a start knows the replica began answering; before it, the
    # request can go to another replica without the client seeing anything.
    body: bytes = b""
    more_body: bool = False


@dataclass
class _Exchange:
    """The app's side of one request: what it sent, and whether the client went away."""

    items: asyncio.Queue[Message | None] = field(default_factory=asyncio.Queue)
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    # The app sent its response's last body (or returned): nothing more to wait for.
    ended: asyncio.Event = field(default_factory=asyncio.Event)


async def _hold(ex: _Exchange, delay_s: float) -> None:
    """Wait `delay_s`, or less if the response ends meanwhile (its end is not held back)."""
    if delay_s <= 0 or ex.ended.is_set():
        return
    try:
        await asyncio.wait_for(ex.ended.wait(), delay_s)
    except asyncio.TimeoutError:
        pass


async def run_app(app: ASGIApp, req: ForwardedRequest,
                  batch_s: float = 0.0) -> AsyncIterator[ResponseStart | bytes]:
    """Run `req` through `app`; yield its `ResponseStart`, then body chunks as they come.

    After the first item, body chunks are held up to `batch_s` after the previous item and
    go as one (Ray Serve LLM's stream batching): a stream then costs the replica, Ray and
    the ingress one message per `batch_s`, not one per token, while the first token and the
    response's end go at once. With `batch_s` 0 only the chunks that queued while the caller
    was busy are joined. Closing this generator early, as Ray does when the client went
    away, tells the app the client disconnected, so it aborts the engine request.
    """
    ex = _Exchange()
    task = asyncio.create_task(_call(app, req, ex))
    start: Message | None = None
    loop = asyncio.get_running_loop()
    last_s: float | None = None  # when the previous item went (None: nothing yet)
    try:
        while True:
            if last_s is not None and batch_s > 0:
                await _hold(ex, last_s + batch_s - loop.time())
            msg = await ex.items.get()
            if msg is None:  # the app returned
                if start is not None:  # a start with no body message (not seen in practice)
                    yield _start(start, b"", more_body=False)
                return
            if msg["type"] == "http.response.start":
                start = msg
                continue
            body, more = _drain(msg, ex.items)
            if start is not None:
                yield _start(start, body, more)
                start = None
            elif body:
                yield body
            last_s = loop.time()
            if not more:
                return
    finally:
        ex.gone.set()
        if not task.done():
            # The app notices the disconnect (its `receive` returns), aborts the request and
            # returns; give it a moment before cancelling outright.
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()


def _drain(msg: Message, items: asyncio.Queue[Message | None]) -> tuple[bytes, bool]:
    """This body message joined with the ones already queued behind it."""
    parts = [msg.get("body", b"")]
    more = bool(msg.get("more_body", False))
    while more and not items.empty():
        nxt = items.get_nowait()
        if nxt is None or nxt["type"] != "http.response.body":
            more = False
            break
        parts.append(nxt.get("body", b""))
        more = bool(nxt.get("more_body", False))
    return b"".join(parts), more


def _start(msg: Message, body: bytes, more_body: bool) -> ResponseStart:
    headers = tuple((bytes(k), bytes(v)) for k, v in msg.get("headers", ()))
    return ResponseStart(int(msg["status"]), headers, body, more_body)


async def _call(app: ASGIApp, req: ForwardedRequest, ex: _Exchange) -> None:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode(),
        "root_path": "",
        "query_string": req.query_string,
        "headers": list(req.headers),
        "client": req.client,
        "server": None,
        "state": {},
    }
    sent_body = False

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await ex.gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: Message) -> None:
        if ex.gone.is_set():
            raise OSError("the client went away")  # what a closed socket tells an ASGI app
        ex.items.put_nowait(msg)
        if msg["type"] == "http.response.body" and not msg.get("more_body", False):
            ex.ended.set()

    try:
        await app(scope, receive, send)
    finally:
        ex.items.put_nowait(None)
        ex.ended.set()
