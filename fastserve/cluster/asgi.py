"""Stream batching on a replica's own HTTP server: an ASGI middleware around the single
server's app.

A replica serves exactly the single server's app (`fastserve.server.app.build_app`) on its own
uvicorn (`replica.ReplicaHTTP`), and the fleet's ingress copies its responses to the clients.
`BatchedStreams` joins a streamed response's body chunks after the first into one write per
`batch_s` (Ray Serve LLM's stream batching): each write costs the replica's event loop, the
ingress's read and its write to the client, far more than a token's SSE bytes. The response's
start, its first body chunk (the first token) and its last go at once. No Ray here: plain
asyncio, tested without a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BatchedStreams:
    """`app`, with each response's body chunks after the first sent at most once per
    `batch_s` (0: unchanged)."""

    def __init__(self, app: ASGIApp, batch_s: float) -> None:
        self.app = app
        self.batch_s = batch_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.batch_s <= 0:
            await self.app(scope, receive, send)
            return
        batcher = _Batcher(send, self.batch_s)
        try:
            await self.app(scope, receive, batcher.send)
        finally:
            await batcher.close()


class _Batcher:
    """One response's `send`, holding body chunks after the first for up to `batch_s`."""

    def __init__(self, send: Send, batch_s: float) -> None:
        self._send = send
        self.batch_s = batch_s
        self.loop = asyncio.get_running_loop()
        self.pending: list[bytes] = []  # body held since the last write
        self.last_s: float | None = None  # when body bytes were last written (None: not yet)
        self.timer: asyncio.Task[None] | None = None  # the write of what is held, due
        # NOTE: one write at a time: the timer's and the app's sends never interleave.
        self.lock = asyncio.Lock()
        self.error: BaseException | None = None  # the timer's write failed: the app is told

    async def send(self, msg: Message) -> None:
        if self.error is not None:
            raise self.error
        if (msg["type"] == "http.response.body" and msg.get("more_body", False)
                and self.last_s is not None):
            self.pending.append(msg.get("body", b""))
            if self.timer is None:
                due_s = self.last_s + self.batch_s - self.loop.time()
                self.timer = self.loop.create_task(self._write_after(due_s))
            return
        # The start, the first body or the last: at once, after what is held.
        async with self.lock:
            await self._write_pending()
            await self._send(msg)
        if msg["type"] == "http.response.body":
            self.last_s = self.loop.time()

    async def close(self) -> None:
        """The app returned: write what it left held (a response it did not end)."""
        async with self.lock:
            with contextlib.suppress(Exception):  # the client went away: nobody to tell
                await self._write_pending()
        if self.timer is not None:
            # NOTE: safe: nothing is held, so the timer is asleep or past its last await.
            self.timer.cancel()

    async def _write_after(self, delay_s: float) -> None:
        try:
            while True:
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                async with self.lock:
                    await self._write_pending()
                if not self.pending:  # (more came while a slow client took the write)
                    return
                delay_s = (self.last_s or 0.0) + self.batch_s - self.loop.time()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.error = exc
        finally:
            self.timer = None

    async def _write_pending(self) -> None:
        if not self.pending:
            return
        body = b"".join(self.pending)
        self.pending.clear()
        self.last_s = self.loop.time()
        await self._send({"type": "http.response.body", "body": body, "more_body": True})
