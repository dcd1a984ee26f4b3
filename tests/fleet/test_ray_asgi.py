"""The fleet's HTTP path without Ray: a replica's own HTTP server (`ReplicaHTTP`, stream
batching on) behind the ingress (`FleetIngress`), over real sockets. A stream comes through
whole, its first token and its end at once; a replica that is not there costs a retry, not
the request; none at all is a 503; a client that goes away is a disconnect the replica's app
sees."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

pytest.importorskip("ray.serve", reason="the fleet needs Ray Serve: pip install 'fastserve[cluster]'")

from fastserve.cluster.asgi import BatchedStreams  # noqa: E402
from fastserve.cluster.ingress import FleetIngress  # noqa: E402
from fastserve.cluster.metrics import FleetMetrics  # noqa: E402
from fastserve.cluster.proxy import ReplicaClient  # noqa: E402
from fastserve.cluster.replica import ReplicaHTTP, SenderCounted  # noqa: E402
from fastserve.cluster.router import Target  # noqa: E402
from fastserve.engine.async_llm import SENDER  # noqa: E402
from fastserve.fleet.router import RouteRequest  # noqa: E402


def _app(events: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"got": body, "q": request.url.query}, status_code=201,
                            headers={"x-seen": "yes"})

    @app.get("/sender")
    async def sender() -> JSONResponse:  # who the engine would count this request for
        return JSONResponse({"sender": SENDER.get()})

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


class FixedReplicas:
    """A table of fixed replicas, tried in order, those marked down left out (the ingress's
    `Replicas`, as `router.ReplicaTable` keeps them)."""

    def __init__(self, urls: list[str]) -> None:
        self.targets = [Target(f"r{i}", url) for i, url in enumerate(urls)]
        self.down: list[str] = []
        self.forgotten: list[str] = []

    def choose(self, route: RouteRequest | None,
               exclude: frozenset[str] = frozenset()) -> Target | None:
        return next((t for t in self.targets
                     if t.replica_id not in exclude and t.replica_id not in self.down), None)

    def mark_down(self, replica_id: str) -> None:
        self.down.append(replica_id)

    def forget(self, target: Target) -> None:
        self.forgotten.append(target.replica_id)


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nobody listens there once closed


@pytest.fixture(scope="module")
def replica() -> Iterator[tuple[ReplicaHTTP, list[str]]]:
    events: list[str] = []
    http = ReplicaHTTP(SenderCounted(BatchedStreams(_app(events), 0.05)), "127.0.0.1")
    yield http, events
    asyncio.run(http.stop())


def _ingress(urls: list[str], attempts: int = 3) -> FleetIngress:
    return FleetIngress(FixedReplicas(urls), ReplicaClient(sender="ingress-1"),
                        FleetMetrics(dict), None, 1 << 20, max_attempts=attempts)


def _serve(app: FleetIngress) -> tuple[str, Callable[[], None]]:
    """`app` on a uvicorn of its own thread, as the fleet serves it; (url, stop it)."""
    import threading

    import uvicorn

    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))

    async def serve() -> None:
        try:
            await server.serve(sockets=[sock])
        finally:
            await app.client.close()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(30)

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def test_a_request_and_a_stream_come_through_whole(replica: tuple[ReplicaHTTP, list[str]]) -> None:
    http, _ = replica
    ingress = _ingress([_closed_port_url(), http.url])
    url, stop = _serve(ingress)
    try:
        echoed = httpx.post(url + "/echo?x=2", json={"a": 1}, timeout=30)
        assert echoed.status_code == 201 and echoed.headers["x-seen"] == "yes"
        assert echoed.json() == {"got": {"a": 1}, "q": "x=2"}
        # The replica's engine counts the request for the ingress, whatever the client says.
        sender = httpx.get(url + "/sender", headers={"x-fastserve-ingress": "forged"}, timeout=30)
        assert sender.json() == {"sender": "ingress-1"}
        t0 = time.perf_counter()
        chunks, first_s = [], 0.0
        with httpx.stream("GET", url + "/tokens", timeout=30) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            for chunk in resp.iter_raw():
                first_s = first_s or time.perf_counter() - t0
                chunks.append(chunk)
        whole_s = time.perf_counter() - t0
    finally:
        stop()
    whole = b"".join(f"data: {i}\n\n".encode() for i in range(40)) + b"data: [DONE]\n\n"
    assert b"".join(chunks) == whole  # nothing lost, nothing reordered
    assert len(chunks) <= 10  # ~200 ms of tokens in 50 ms batches, not one write per token
    assert first_s < 0.5 and whole_s < 1.0  # the first token and the end are not held
    # The replica that was not listening was tried once, then left out, and the request sent
    # there not counted there; a request that is not a generation is not counted either.
    assert isinstance(ingress.replicas, FixedReplicas) and ingress.replicas.down == ["r0"]
    assert ingress.replicas.forgotten == ["r0", "r1", "r1", "r1"]


def test_no_replica_is_a_503_after_the_attempts() -> None:
    url, stop = _serve(_ingress([_closed_port_url(), _closed_port_url()], attempts=3))
    try:
        resp = httpx.post(url + "/echo", json={}, timeout=30)
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        stop()
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "replica_unavailable"
    # Each tried once and left out: the third attempt finds no replica to send to.
    assert "fastserve_fleet_retries_total 2.0" in metrics


def test_a_client_going_away_is_a_disconnect_at_the_replica(
        replica: tuple[ReplicaHTTP, list[str]]) -> None:
    http, events = replica
    url, stop = _serve(_ingress([http.url]))
    try:
        with httpx.stream("GET", url + "/stream", timeout=30) as resp:
            for n, _ in enumerate(resp.iter_raw()):
                if n == 2:
                    break
        deadline = time.monotonic() + 10
        while "closed" not in events and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop()
    assert events and events[-1] == "closed"  # the app's generator ended, not left running


def test_fleet_metrics_need_the_key_when_asked() -> None:
    """`--metrics-require-key` on a fleet: its ingress answers /metrics itself (the replicas'
    gates guard the documents and the API)."""
    def ingress(key: str | None) -> FleetIngress:
        return FleetIngress(FixedReplicas([]), ReplicaClient(), FleetMetrics(dict), None,
                            1 << 20, max_attempts=1, metrics_key=key)

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
