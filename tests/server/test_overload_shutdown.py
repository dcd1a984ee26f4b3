"""Overload (429 with Retry-After) and graceful SIGTERM shutdown, on real server processes.

Every server fixture also checks, when it stops the server with SIGTERM, that it exits 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.helpers import ServerProcess, managed, start_server, validate

MODEL = "tiny"


@pytest.fixture(scope="module")
def small_server(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    yield from managed(
        # FCFS: a running job keeps the only batch slot (skip-join MLFQ would preempt it).
        start_server(server_tmp, "--max-waiting", "1", "--max-batch-size", "1", "--scheduler", "fcfs",
                     "--no-warmup")
    )


def test_queue_full_is_429_with_retry_after(small_server: ServerProcess) -> None:
    short = {"model": MODEL, "prompt": "Overload", "max_tokens": 4, "ignore_eos": True}
    long = {**short, "max_tokens": 1500, "stream": True}
    client = openai.OpenAI(base_url=small_server.v1, api_key="unused", max_retries=0)

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=small_server.v1, timeout=120) as http:
            # Fill the batch (size 1) with a long stream, then burst: one request may wait,
            # the rest find the queue (max_waiting 1) full.
            async with http.stream("POST", "/completions", json=long) as running:
                lines = running.aiter_lines()  # NOTE: keep it; a dropped iterator closes the stream
                await anext(lines)
                burst = [asyncio.create_task(http.post("/completions", json=short)) for _ in range(5)]
                done, pending = await asyncio.wait(burst, timeout=60, return_when=asyncio.FIRST_COMPLETED)
                while len(done) < 4:
                    more, pending = await asyncio.wait(pending, timeout=60, return_when=asyncio.FIRST_COMPLETED)
                    done |= more
                with pytest.raises(openai.RateLimitError):  # the openai client's view of it
                    await asyncio.to_thread(client.completions.create, model=MODEL, prompt="x", max_tokens=1)
            # Leaving the stream aborted the long request; the waiting one runs now.
            return list(await asyncio.gather(*burst))

    responses = asyncio.run(fire())
    codes = [r.status_code for r in responses]
    assert sorted(codes) == [200, 429, 429, 429, 429], codes
    for resp in responses:
        if resp.status_code == 429:
            assert int(resp.headers["Retry-After"]) >= 1
            validate(resp.json(), "ErrorResponse")
            assert resp.json()["error"]["code"] == "queue_full"
        else:
            assert resp.json()["usage"]["completion_tokens"] == 4
    m = small_server.metrics()
    assert m['fastserve_http_errors_total{status="429"}'] == 5
    assert m["fastserve_kv_blocks_free"] == m["fastserve_kv_blocks_total"]


def test_client_leaving_the_queue_frees_its_place(small_server: ServerProcess) -> None:
    long = {"model": MODEL, "prompt": "Hold the slot", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    short = {"model": MODEL, "prompt": "queued", "max_tokens": 2, "ignore_eos": True}
    with httpx.stream("POST", small_server.v1 + "/completions", json=long, timeout=60) as running:
        lines = running.iter_lines()
        next(lines)
        # Queued behind the running job, then the client gives up before its first token.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(small_server.v1 + "/completions", json=short, timeout=0.5)
        deadline = time.monotonic() + 5
        while small_server.metrics()["fastserve_requests_waiting"] > 0:
            assert time.monotonic() < deadline, "the abandoned request is still queued"
            time.sleep(0.05)
        assert small_server.metrics()["fastserve_requests_running"] == 1
        # Its place in the queue (max_waiting 1) is free again: this one is accepted, not 429.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(small_server.v1 + "/completions", json=short, timeout=0.5)


def test_sigterm_drains_with_503_while_running_requests_finish(server_tmp: Path, tiny_model_ready: Path) -> None:
    """During the drain the listener stays open: /health and new requests get 503 (a load
    balancer routes elsewhere) while the running requests finish; then the server exits 0."""
    server = start_server(server_tmp, "--no-warmup", "--grace-period-s", "60")
    try:
        body = {"model": MODEL, "prompt": "Long story", "max_tokens": 60, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        held = {**body, "max_tokens": 1800}  # keeps the drain open until this client leaves
        chunks: list[dict[str, object]] = []
        done = False
        with httpx.Client(base_url=server.v1, timeout=60) as http, \
                http.stream("POST", "/completions", json=held) as held_resp:
            held_lines = held_resp.iter_lines()
            assert next(line for line in held_lines if line.startswith("data: "))
            with http.stream("POST", "/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunks.append(json.loads(line[6:]))
                        if len(chunks) == 2:
                            server.proc.send_signal(signal.SIGTERM)
                            health = _health_once_draining(server.url, within_s=10)
                            assert health.json()["error"]["code"] == "shutdown"
                            refused = httpx.post(server.v1 + "/chat/completions", timeout=10, json={
                                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
                            assert refused.status_code == 503, refused.text
                            validate(refused.json(), "ErrorResponse")
                            assert refused.json()["error"]["code"] == "shutdown"
            assert done
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
            assert chunks[-1]["usage"]["completion_tokens"] == 60  # type: ignore[index]
            assert server.proc.poll() is None  # still draining: the held stream runs
        # Leaving the held stream aborts it: the drain is over.
        assert server.proc.wait(60) == 0, server.log()[-3000:]
        assert "draining" in server.log() and "shut down" in server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def _health_once_draining(url: str, within_s: float) -> httpx.Response:
    """/health once it answers 503 (the signal reaches the server a moment after it is sent);
    every answer before is 200: the listener never closes."""
    deadline = time.monotonic() + within_s
    while True:
        resp = httpx.get(url + "/health", timeout=5)
        if resp.status_code == 503 or time.monotonic() > deadline:
            assert resp.status_code == 503, resp.text
            validate(resp.json(), "ErrorResponse")
            return resp
        assert resp.status_code == 200
        time.sleep(0.02)
