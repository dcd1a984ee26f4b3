"""One bad request fails alone, on a real server: hostile-but-valid payloads next to running
streams, text that is not Unicode on a keep-alive connection."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.helpers import ServerProcess, managed, start_server, validate

MODEL = "tiny"
NUM_STREAMS = 10
STREAM_TOKENS = 120


@pytest.fixture(scope="module")
def server(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    yield from managed(start_server(server_tmp, "--no-warmup", "--max-batch-size", "16"))


async def _stream(http: httpx.AsyncClient, started: asyncio.Event, n_started: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": STREAM_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events: list[dict[str, Any]] = []
    async with http.stream("POST", "/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        first = True
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return {"events": events, "done": True}
            events.append(json.loads(line[6:]))
            if first:
                first = False
                n_started[0] += 1
                if n_started[0] == NUM_STREAMS:
                    started.set()
    return {"events": events, "done": False}


BAD_PAYLOADS: list[tuple[dict[str, Any], int, str | None]] = [
    ({"prompt": "hello", "max_tokens": 4, "temperature": 1e-300}, 200, None),
    ({"prompt": "hello", "max_tokens": 4, "stop_token_ids": [1000000000], "min_tokens": 2}, 400,
     "stop_token_ids"),
    ({"prompt": "hello", "max_tokens": 4, "top_k": 1180591620717411303424, "temperature": 1.0}, 200,
     None),
    ({"prompt": "hello", "max_tokens": 4, "stop_token_ids": [2**70]}, 400, "stop_token_ids"),
]


def test_bad_payloads_fail_alone_while_ten_streams_run(server: ServerProcess) -> None:
    async def run() -> tuple[list[dict[str, Any]], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.v1, timeout=300) as http:
            started, n_started = asyncio.Event(), [0]
            streams = [asyncio.create_task(_stream(http, started, n_started)) for _ in range(NUM_STREAMS)]
            await asyncio.wait_for(started.wait(), 120)
            answers = [await http.post("/completions", json={"model": MODEL, **p}) for p, _, _ in BAD_PAYLOADS]
            return list(await asyncio.gather(*streams)), answers

    results, answers = asyncio.run(run())
    for (_, status, param), resp in zip(BAD_PAYLOADS, answers):
        assert resp.status_code == status, resp.text
        if status == 400:
            validate(resp.json(), "ErrorResponse")
            assert resp.json()["error"]["param"] == param
        else:
            assert resp.json()["usage"]["completion_tokens"] == 4
    for result in results:
        assert result["done"]
        assert not any("error" in e for e in result["events"])
        assert result["events"][-1]["usage"]["completion_tokens"] == STREAM_TOKENS
        finishes = [c["finish_reason"] for e in result["events"] for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"]
    m = server.metrics()
    assert m["fastserve_kv_blocks_free"] == m["fastserve_kv_blocks_total"]


def _post(conn: http.client.HTTPConnection, path: str, raw_body: str) -> tuple[int, dict[str, Any]]:
    conn.request("POST", path, body=raw_body.encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


@pytest.mark.parametrize(
    ("path", "raw_body", "param"),
    [
        ("/v1/completions", '{"model":"tiny","prompt":"\\ud800x","max_tokens":4}', "prompt"),
        ("/v1/chat/completions",
         '{"model":"tiny","messages":[{"role":"user","content":"\\udfff"}],"max_tokens":4}',
         "messages[0].content"),
        ("/v1/completions", '{"model":"tiny","prompt":"hi","stop":["\\udfff"],"max_tokens":4}', "stop"),
        # pydantic refuses such a key before it knows the field: no `param`, still a 400
        ("/v1/completions", '{"model":"tiny","prompt":"hi","\\ud800":1}', None),
    ],
)
def test_text_that_is_not_unicode_is_a_400_and_the_connection_stays(
    server: ServerProcess, path: str, raw_body: str, param: str | None
) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        status, body = _post(conn, path, raw_body)
        sock = conn.sock
        assert status == 400, body
        validate(body, "ErrorResponse")
        assert body["error"]["param"] == param
        status, body = _post(conn, "/v1/completions", '{"model":"tiny","prompt":"hi","max_tokens":3}')
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        assert conn.sock is sock  # the same keep-alive connection answered
    finally:
        conn.close()
