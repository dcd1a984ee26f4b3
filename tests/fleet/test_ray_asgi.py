"""The replica side of the fleet's forwarding (`fastserve.cluster.asgi`), without Ray: a request
run through a real FastAPI app in-process comes back as its status, headers and body; a
caller that stops reading is a client that went away, as the app sees it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from fastserve.cluster.asgi import ForwardedRequest, ResponseStart, run_app


def _app(events: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"got": body, "q": request.url.query}, status_code=201,
                            headers={"x-seen": "yes"})

    @app.get("/tokens")
    async def tokens() -> StreamingResponse:
        async def gen() -> AsyncIterator[bytes]:
            for i in range(40):  # a token every 5 ms, as a busy engine makes them
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.005)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def gen() -> AsyncIterator[bytes]:
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(0.01)
                    if await request.is_disconnected():
                        events.append("disconnected")
                        return
            finally:
                events.append("closed")

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def _req(method: str, path: str, body: bytes = b"", query: bytes = b"") -> ForwardedRequest:
    headers = ((b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()))
    return ForwardedRequest(method, path, query, headers, body, ("127.0.0.1", 5000))


def test_a_request_comes_back_whole() -> None:
    async def run() -> list[ResponseStart | bytes]:
        return [item async for item in run_app(_app([]), _req("POST", "/echo", b'{"a": 1}', b"x=2"))]

    items = asyncio.run(run())
    start = items[0]
    assert isinstance(start, ResponseStart) and start.status == 201
    assert (b"x-seen", b"yes") in start.headers
    body = start.body + b"".join(i for i in items[1:] if isinstance(i, bytes))
    assert body == b'{"got":{"a":1},"q":"x=2"}'


def test_stopping_to_read_is_a_disconnect() -> None:
    events: list[str] = []

    async def run() -> list[bytes]:
        got = []
        items = run_app(_app(events), _req("GET", "/stream"))
        async for item in items:
            got.append(item.body if isinstance(item, ResponseStart) else item)
            if len(got) == 3:
                break
        await items.aclose()  # what Ray does when the ingress cancels the call
        return got

    got = asyncio.run(run())
    assert got[0].startswith(b"data: 0")
    assert events and events[-1] == "closed"  # the app's generator ended, not left running


def test_fleet_metrics_need_the_key_when_asked() -> None:
    """`--metrics-require-key` on a fleet: its ingress answers /metrics itself (the replicas'
    gates guard the documents and the API)."""
    import httpx

    from fastserve.cluster.ingress import FleetIngress
    from fastserve.cluster.metrics import FleetMetrics

    class NoReplicas:
        def options(self, *, stream: bool, _by_reference: bool) -> object:
            return self

    def ingress(key: str | None) -> FleetIngress:
        return FleetIngress(NoReplicas(), FleetMetrics(dict), None, 1 << 20, max_attempts=1,
                            metrics_key=key)

    async def get(app: FleetIngress, headers: list[tuple[str, str]]) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://fleet") as client:
            return await client.get("/metrics", headers=headers)

    keyed = ingress("sekrit")
    refused = asyncio.run(get(keyed, []))
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert "fastserve_fleet" not in refused.text
    twice = asyncio.run(get(keyed, [("Authorization", "Bearer sekrit")] * 2))
    assert twice.status_code == 400
    shown = asyncio.run(get(keyed, [("Authorization", "Bearer sekrit")]))
    assert shown.status_code == 200 and "fastserve_fleet_requests" in shown.text
    assert asyncio.run(get(ingress(None), [])).status_code == 200  # open without the flag


def test_a_stream_goes_in_batches_with_its_first_token_and_end_at_once() -> None:
    async def run(batch_s: float) -> tuple[list[bytes], float, float]:
        got: list[bytes] = []
        t0 = time.perf_counter()
        first_s = 0.0
        async for item in run_app(_app([]), _req("GET", "/tokens"), batch_s):
            if isinstance(item, ResponseStart):
                first_s = time.perf_counter() - t0
            got.append(item.body if isinstance(item, ResponseStart) else item)
        return got, first_s, time.perf_counter() - t0

    whole = b"".join(f"data: {i}\n\n".encode() for i in range(40)) + b"data: [DONE]\n\n"
    each, _, each_s = asyncio.run(run(0.0))
    batched, first_s, batched_s = asyncio.run(run(0.05))
    assert b"".join(each) == b"".join(batched) == whole  # nothing lost, nothing reordered
    assert len(each) >= 30  # one item per token when nothing holds them
    assert len(batched) <= 8  # ~200 ms of tokens in 50 ms batches, the first alone
    assert batched[0] == b"data: 0\n\n" and first_s < 0.04  # the first token is not held
    assert batched_s < each_s + 0.04  # nor the end: [DONE] goes as soon as it is made
