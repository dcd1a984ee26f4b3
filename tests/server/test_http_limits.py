"""The read deadlines and the connection cap in both of uvicorn's HTTP implementations
(httptools, which `fastserve serve` runs when installed, and h11), on a real uvicorn server
with a small app in this process: no model, so each case takes about its deadline."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http import auto
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from fastserve.server.http_limits import HTTPLimits, limited_protocol

LIMITS = HTTPLimits(header_timeout_s=0.5, read_timeout_s=1.0, max_connections=4)


async def echo_length(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the whole body, answers its length."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def serving(base: type) -> AsyncIterator[int]:
    """A uvicorn server on a free port with `LIMITS` over `base`; yields the port."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(auto, "AutoHTTPProtocol", base)
        protocol = limited_protocol(LIMITS)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(echo_length, http=protocol, lifespan="off",
                                           log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


async def closed_with(port: int, sent: bytes) -> tuple[bytes, float]:
    """Send `sent` on a new connection; what comes back before the server closes it, and
    after how long."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(sent)
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data, time.monotonic() - start


@pytest.mark.parametrize("base", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def test_deadlines_and_cap(base: type) -> None:
    async def run() -> None:
        async with serving(base) as port:
            whole = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc"
            data, _ = await closed_with(port, whole)
            assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"3"), data

            data, waited = await closed_with(port, b"POST / HTTP/1.1\r\nHost: x\r\n")
            assert data.startswith(b"HTTP/1.1 408 ") and b"headers" in data, data
            assert 0.4 < waited < 2.0, waited

            data, waited = await closed_with(
                port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
            assert data.startswith(b"HTTP/1.1 408 ") and b"body" in data, data
            assert 0.9 < waited < 2.5, waited

            # A slow but steady body within the read deadline is served.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nConnection: close\r\n\r\n")
            for byte in b"abcd":
                await asyncio.sleep(0.15)
                writer.write(bytes([byte]))
            data = await asyncio.wait_for(reader.read(), 10)
            assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"4"), data
            writer.close()

            idle = [await asyncio.open_connection("127.0.0.1", port)
                    for _ in range(LIMITS.max_connections)]
            data, _ = await closed_with(port, b"")
            assert data.startswith(b"HTTP/1.1 503 ") and b"--max-connections" in data, data
            for _, writer in idle:
                writer.close()

    asyncio.run(run())


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="http_read_timeout_s"):
        HTTPLimits(header_timeout_s=10, read_timeout_s=5)
    with pytest.raises(ValueError, match="max_connections"):
        HTTPLimits(max_connections=0)
