"""A server facing the internet: requests that never finish sending are closed by the read
deadlines while others are served, open connections are capped, and `--metrics-require-key`
puts the metrics and the API's documents behind the key; two Authorization headers are
refused. One real server, with short deadlines and a small cap."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import ServerProcess, managed, start_server

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 4.0
MAX_CONNECTIONS = 300
NUM_HALF_SENT = 200


@pytest.fixture(scope="module")
def exposed(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    yield from managed(start_server(
        server_tmp, "--no-warmup", "--no-startup-profile", "--api-key", KEY,
        "--metrics-require-key", "--http-header-timeout-s", str(HEADER_TIMEOUT_S),
        "--http-read-timeout-s", str(READ_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)))


def complete(server: ServerProcess) -> httpx.Response:
    return httpx.post(server.v1 + "/completions", headers=AUTH, timeout=60,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 4})


async def open_half_sent(host: str, port: int, partial: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(partial)
    await writer.drain()
    return reader, writer


async def read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> tuple[bytes, float]:
    """What the server sends before it closes the connection, and when it closed it."""
    data = await asyncio.wait_for(reader.read(), timeout_s)
    return data, time.monotonic()


def test_half_sent_requests_are_closed_while_others_are_served(exposed: ServerProcess) -> None:
    host, port = exposed.url.removeprefix("http://").split(":")
    headers_only = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    short_body = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")

    async def run() -> None:
        half = NUM_HALF_SENT // 2
        start = time.monotonic()
        conns = [await open_half_sent(host, int(port), headers_only) for _ in range(half)]
        conns += [await open_half_sent(host, int(port), short_body) for _ in range(half)]
        # The server keeps serving while they hang.
        served = await asyncio.to_thread(complete, exposed)
        assert served.status_code == 200, served.text
        assert time.monotonic() - start < HEADER_TIMEOUT_S, "served only after the timeouts"
        ends = await asyncio.gather(*(read_until_closed(r, READ_TIMEOUT_S + 10) for r, _ in conns))
        for i, (data, closed_s) in enumerate(ends):
            waited = closed_s - start
            if i < half:
                assert data.startswith(b"HTTP/1.1 408 "), data
                assert b"headers did not arrive within 2 s (--http-header-timeout-s)" in data
                assert HEADER_TIMEOUT_S - 0.5 < waited < HEADER_TIMEOUT_S + 5, waited
            else:
                assert data.startswith(b"HTTP/1.1 408 "), data
                assert b"body did not arrive within 4 s (--http-read-timeout-s)" in data
                assert READ_TIMEOUT_S - 0.5 < waited < READ_TIMEOUT_S + 5, waited
        for _, writer in conns:
            writer.close()

    asyncio.run(run())
    assert complete(exposed).status_code == 200


def test_a_kept_alive_connection_gets_the_header_deadline_for_each_request(
        exposed: ServerProcess) -> None:
    """A client that sends one whole request, then half of the next, on one connection."""
    host, port = exposed.url.removeprefix("http://").split(":")

    async def run() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        first = await reader.readuntil(b'{"status":"ok"}')
        assert first.startswith(b"HTTP/1.1 200 "), first
        start = time.monotonic()
        writer.write(b"GET /health HTTP/1.1\r\nHost:")
        data, closed_s = await read_until_closed(reader, HEADER_TIMEOUT_S + 10)
        assert data.startswith(b"HTTP/1.1 408 "), data
        assert closed_s - start < HEADER_TIMEOUT_S + 5
        writer.close()

    asyncio.run(run())


def test_connections_over_the_cap_get_503(exposed: ServerProcess) -> None:
    host, port = exposed.url.removeprefix("http://").split(":")

    async def run() -> None:
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(MAX_CONNECTIONS)]
        reader, _ = await asyncio.open_connection(host, int(port))
        data, _ = await read_until_closed(reader, 10)
        assert data.startswith(b"HTTP/1.1 503 "), data
        assert b"retry-after: 1" in data.lower()
        assert b"--max-connections" in data
        for _, writer in idle:
            writer.close()
            await writer.wait_closed()

    asyncio.run(run())
    deadline = time.monotonic() + 10  # the server sees the closes
    while (status := complete(exposed).status_code) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 200


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/redoc", "/openapi.json"])
def test_metrics_and_docs_need_the_key(exposed: ServerProcess, path: str) -> None:
    refused = httpx.get(exposed.url + path, timeout=10)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert "vocab" not in refused.text and "tiny" not in refused.text
    assert httpx.get(exposed.url + path, headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(exposed.url + "/health", timeout=10).status_code == 200  # still open


def test_metrics_and_docs_stay_open_without_the_flag(server: ServerProcess) -> None:
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200, path


@pytest.mark.parametrize("second", [f"Bearer {KEY}", "Bearer wrong"])
def test_two_authorization_headers_are_refused(exposed: ServerProcess, second: str) -> None:
    """Whichever comes last: a proxy may read the first, the server the last."""
    for headers in ([("Authorization", f"Bearer {KEY}"), ("Authorization", second)],
                    [("Authorization", second), ("Authorization", f"Bearer {KEY}")]):
        resp = httpx.get(exposed.v1 + "/models", headers=headers, timeout=10)
        assert resp.status_code == 400, resp.text
        assert "2 Authorization headers" in resp.json()["error"]["message"]
    assert httpx.get(exposed.v1 + "/models", headers=AUTH, timeout=10).status_code == 200


def test_metrics_require_key_needs_a_key() -> None:
    from fastserve.server.cli import ServeOptions

    with pytest.raises(ValueError, match="--metrics-require-key needs a key"):
        ServeOptions(metrics_require_key=True)
