"""Server-sent events and the client's connection: a request's outputs as a stream ending with
`data: [DONE]` (or an error event); a client that goes away aborts its request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from fastserve.engine.async_llm import EngineDeadError
from fastserve.request import RequestOutput
from fastserve.server.gate import ClientDisconnected, engine_dead, engine_failure
from fastserve.server.schemas import APIError

T = TypeVar("T")


def sse_data(payload: dict[str, Any]) -> str:
    return f"data: {_json(payload)}\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    """A typed event (the Responses API's): `event: <its type>` before its data."""
    return f"event: {payload['type']}\n" + sse_data(payload)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


TEXT_SLOT = "\x00text\x00"  # stands for the text in a chunk rendered once per stream


class TextChunk:
    """A stream's text chunk as two fixed halves around the text: one `json.dumps` per token.

    NOTE: built by rendering the real pydantic chunk once, so the shape cannot drift from it;
    per token, validating and dumping a model would cost more than the model's decode step.
    """

    def __init__(self, rendered: str) -> None:
        self.head, self.tail = rendered.split(_json(TEXT_SLOT))

    def __call__(self, text: str) -> str:
        return self.head + _json(text) + self.tail


async def stream_outputs(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput | APIError]:
    """The request's outputs, then an APIError if the engine failed it (and nothing after).

    NOTE: closing this generator closes `rest`, the engine iterator, which aborts an
    unfinished request; an `async for` left early would not close it by itself.
    """
    try:
        out = first
        while True:
            if out.is_failure:
                yield engine_failure(out)
                return
            yield out
            if out.ends_request:
                return
            try:
                out = await anext(rest)
            except EngineDeadError as exc:
                yield engine_dead(exc)
                return
            except StopAsyncIteration:
                yield engine_failure(out)
                return
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """The items of several streams as they come, each with its stream's place in the list.

    NOTE: closing this generator closes every stream (`stream_outputs`: aborts its request),
    the ones it was waiting on included."""
    if len(streams) == 1:  # one prompt's stream (the usual case): no task per item
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return

    async def next_of(i: int) -> tuple[int, T] | None:  # None: stream i has ended
        try:
            return i, await anext(streams[i])
        except StopAsyncIteration:
            return None

    waiting = {asyncio.ensure_future(next_of(i)) for i in range(len(streams))}
    try:
        while waiting:
            ready, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            pairs = [pair for task in ready if (pair := task.result()) is not None]
            for i, item in sorted(pairs, key=lambda pair: pair[0]):
                yield i, item
                waiting.add(asyncio.ensure_future(next_of(i)))
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


async def final_outputs(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    """The final output of each of the request's sequences, by index (non-streaming). Raises
    APIError if the engine failed the request."""
    events = stream_outputs(first, rest)
    finals: list[RequestOutput] = []
    try:
        async for out in events:
            if isinstance(out, APIError):
                raise out
            if out.finished:
                finals.append(out)
            if out.ends_request:
                return sorted(finals, key=lambda o: o.index)
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    raise engine_failure(first)  # unreachable: stream_outputs ends with a finished output or error


async def _wait_disconnect(request: Request) -> None:
    # NOTE: the body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(request: Request, work: Awaitable[T]) -> T:
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


class EventStream(StreamingResponse):
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
