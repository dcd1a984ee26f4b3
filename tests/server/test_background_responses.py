"""The Responses API's background responses (`background: true`): answered at once, generated
by the server whatever the client does, polled with GET, followed or resumed as a stream from
any event, cancelled with POST .../cancel (which stops the engine's work on it)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.server.helpers import ServerProcess

MODEL = "tiny"
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
# A response that cannot end early: its grammar holds 1500 x's (EOS is masked until then).
LONG: dict[str, Any] = {"model": MODEL, "input": "Go on.", "max_output_tokens": 1600, "text": {
    "format": {"type": "json_schema", "name": "xs",
               "schema": {"type": "string", "pattern": "^x{1500}$"}}}}
ENDED = ("completed", "incomplete", "failed", "cancelled")


def _poll(client: openai.OpenAI, response_id: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        resp = client.responses.retrieve(response_id)
        if resp.status in ENDED or time.monotonic() > deadline:
            return resp
        time.sleep(0.05)


def _events(server: ServerProcess, response_id: str, query: str = "") -> list[dict[str, Any]]:
    with httpx.stream("GET", f"{server.v1}/responses/{response_id}?stream=true{query}",
                      timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]


def _text(events: list[Any]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_a_background_response_is_polled_to_its_end(client: openai.OpenAI) -> None:
    started = client.responses.create(input="Tell me a story.", background=True, **GREEDY)
    assert started.background is True and started.status in ("queued", "in_progress")
    done = _poll(client, started.id)
    assert done.status in ("completed", "incomplete") and done.usage is not None
    foreground = client.responses.create(input="Tell me a story.", store=False, **GREEDY)
    assert done.output_text == foreground.output_text  # the same greedy answer


def test_a_background_stream_is_resumed_after_the_client_leaves(client: openai.OpenAI,
                                                                server: ServerProcess) -> None:
    seen = []
    with client.responses.create(input="Count.", background=True, stream=True, **GREEDY) as stream:
        for event in stream:
            seen.append(event.model_dump())
            if len(seen) == 4:  # created, in_progress, and the message begun: leave
                break
    response_id = seen[0]["response"]["id"]
    done = _poll(client, response_id)  # it went on without its client
    assert done.status in ("completed", "incomplete")
    rest = _events(server, response_id, f"&starting_after={seen[-1]['sequence_number']}")
    numbers = [e["sequence_number"] for e in seen + rest]
    assert numbers == list(range(len(numbers)))
    assert _text(seen) + _text(rest) == done.output_text
    assert rest[-1]["type"] == f"response.{done.status}"
    assert [e["sequence_number"] for e in _events(server, response_id)] == numbers  # all again


def test_cancel_stops_a_background_response(client: openai.OpenAI, server: ServerProcess) -> None:
    pytest.importorskip("xgrammar")
    response_id = ""
    with httpx.stream("POST", server.v1 + "/responses", timeout=120,
                      json={**LONG, "background": True, "stream": True}) as resp:
        for line in resp.iter_lines():  # follow it until its text has begun
            if line.startswith("data: "):
                event = json.loads(line[6:])
                response_id = response_id or event["response"]["id"]
                if event["type"] == "response.output_text.delta":
                    break
    cancelled = client.responses.cancel(response_id)
    assert cancelled.status == "cancelled"
    assert 0 < len(cancelled.output_text) < 1502  # what was made before it stopped
    assert [item.status for item in cancelled.output] == ["incomplete"]
    assert client.responses.retrieve(response_id).status == "cancelled"
    assert client.responses.cancel(response_id).status == "cancelled"  # again: as it is
    assert _events(server, response_id)[-1]["type"] != "response.completed"
    deadline = time.monotonic() + 10
    while server.metrics()["fastserve_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    m = server.metrics()
    assert m["fastserve_requests_running"] == 0
    assert m["fastserve_kv_blocks_free"] == m["fastserve_kv_blocks_total"]


def test_deleting_a_running_background_response_cancels_it(client: openai.OpenAI,
                                                           server: ServerProcess) -> None:
    pytest.importorskip("xgrammar")
    started = client.responses.create(background=True, **LONG)
    client.responses.delete(started.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(started.id)
    deadline = time.monotonic() + 10
    while server.metrics()["fastserve_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metrics()["fastserve_requests_running"] == 0


@pytest.mark.parametrize(("method", "path", "body", "param"), [
    ("POST", "/responses", {**GREEDY, "input": "hi", "background": True, "store": False}, "background"),
    ("GET", "/responses/{id}?stream=true", None, "stream"),  # not a background response
    ("GET", "/responses/{id}?starting_after=3", None, "starting_after"),  # only with stream
    ("POST", "/responses/{id}/cancel", None, "response_id"),  # not a background response
])
def test_background_misuse_is_a_400_naming_the_field(client: openai.OpenAI, server: ServerProcess,
                                                     method: str, path: str,
                                                     body: dict[str, Any] | None, param: str) -> None:
    foreground = client.responses.create(input="hi", **GREEDY)
    resp = httpx.request(method, server.v1 + path.format(id=foreground.id), json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
