"""`n` and `best_of` through a real `fastserve serve` process and the official `openai`
client: n choices with their indices, streamed and not, the usage of all of them, the 400s,
and a client that goes away mid-stream freeing every sequence's blocks."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import IS_EXACT_DTYPE
from tests.server.helpers import ServerProcess, managed, start_server, validate

MODEL = "tiny"
PROMPT = "Once upon a time in a land far away there lived"
ENDLESS = {"ignore_eos": True}  # every choice runs to max_tokens: usage is exact


@pytest.fixture(scope="module")
def server(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    yield from managed(start_server(server_tmp, "--served-model-name", MODEL, "--no-warmup",
                                    "--no-startup-profile", "--max-batch-size", "16"))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=120)


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.v1 + path, json={"model": MODEL, **body}, timeout=120)


def test_completion_n3(server: ServerProcess, client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=6, n=3, seed=5,
                              temperature=1.0, extra_body=ENDLESS)
    resp = client.completions.create(**kw)
    validate(resp.model_dump(exclude_unset=True), "CreateCompletionResponse")
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert {c.finish_reason for c in resp.choices} == {"length"}
    texts = [c.text for c in resp.choices]
    assert len(set(texts)) == 3
    assert resp.usage is not None
    one = client.completions.create(**{**kw, "n": 1})
    assert one.usage is not None and one.choices[0].text == texts[0]  # sequence 0: seed 5
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert resp.usage.completion_tokens == 3 * 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 18

    # Streamed: each chunk names its choice; each choice's text is the non-streamed one.
    streamed = ["", "", ""]
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    usage = None
    for chunk in client.completions.create(**kw, stream=True,
                                           stream_options={"include_usage": True}):
        validate(chunk.model_dump(exclude_unset=True), "CreateCompletionStreamResponse")
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason is not None:
                finishes[c.index].append(c.finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert streamed == texts
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert usage is not None and usage.completion_tokens == 18


def test_chat_n3(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                              max_tokens=5, n=3, seed=9, extra_body=ENDLESS)
    resp = client.chat.completions.create(**kw)
    validate(resp.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.message.content for c in resp.choices]
    assert len(set(texts)) == 3
    assert resp.usage is not None and resp.usage.completion_tokens == 15

    streamed = ["", "", ""]
    roles: list[int] = []
    finishes: list[int] = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        validate(chunk.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
        for c in chunk.choices:
            if c.delta.role is not None:
                roles.append(c.index)
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finishes.append(c.index)
    assert sorted(roles) == [0, 1, 2] and sorted(finishes) == [0, 1, 2]
    if IS_EXACT_DTYPE:  # a half type's seeded draws change with the batch (tests/greedy.py)
        assert streamed == texts
    else:
        assert all(streamed) and len(set(streamed)) == 3


def test_best_of(server: ServerProcess, client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, best_of=4,
                                     seed=3, extra_body=ENDLESS)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage is not None and resp.usage.completion_tokens == 8
    # Sequences ranked by probability must be complete: OpenAI refuses to stream them too.
    for body, param in [({"best_of": 3, "stream": True}, "best_of"),
                        ({"n": 3, "best_of": 2}, "best_of"), ({"n": 0}, "n"), ({"n": 129}, "n")]:
        r = _post(server, "/completions", {"prompt": PROMPT, "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    r = _post(server, "/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 2, "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"  # not a chat field


def test_disconnect_aborts_every_choice(server: ServerProcess) -> None:
    # Long enough that no sequence ends before the client goes (the tiny model's context
    # is 2048 tokens); each ends as an abort.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "n": 4, "stream": True,
            **ENDLESS}
    aborted = 'fastserve_requests_finished_total{finish_reason="abort"}'
    before = server.metrics().get(aborted, 0.0)
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60) as resp:
        indices: set[int] = set()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                indices |= {c["index"] for c in json.loads(line[6:])["choices"]}
            if len(indices) == 4:
                break
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        if m["fastserve_kv_blocks_free"] == m["fastserve_kv_blocks_total"] \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m["fastserve_requests_running"] == 0 and m["fastserve_requests_waiting"] == 0
    assert m["fastserve_kv_blocks_free"] == m["fastserve_kv_blocks_total"]
    assert m[aborted] == before + 4  # every sequence, counted as it ends
