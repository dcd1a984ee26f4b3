"""An exception inside the engine fails only the requests it concerns; the server keeps serving.

Fault injection needs the engine in this process: a real AsyncLLM whose executor raises for
requests whose prompt holds a poison token, served by a real uvicorn on a local port.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from fastserve.args import engine_config
from fastserve.core.plan import ExecutorOutput, SchedulerOutput
from fastserve.engine.async_llm import AsyncLLM
from fastserve.request import RequestOutput, SamplingParams
from fastserve.server.app import build_app
from tests.conftest import TEST_DTYPE
from tests.server.helpers import validate

POISON = 4  # a prompt holding this token id fails on its 3rd decode step
FAIL_AT_OUTPUT = 3


class _FailingExecutor:
    """Wraps the real executor; raises for any batch with a poisoned request in it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.poisoned: set[str] = set()

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        for s in plan.scheduled:
            if s.is_prefill and POISON in s.token_ids:
                self.poisoned.add(s.request_id)
            if s.request_id in self.poisoned and s.num_output_tokens >= FAIL_AT_OUTPUT:
                raise RuntimeError("injected device fault")
        return self.inner.execute(plan)


@pytest.fixture(scope="module")
def llm(tiny_model_ready: Any) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(engine_config(dtype=TEST_DTYPE, warmup=False, kv_cache_gib=0.125))
    llm.engine.core.executor = _FailingExecutor(llm.engine.core.executor)  # type: ignore[assignment]
    yield llm
    asyncio.run(llm.shutdown(grace_s=0))


@pytest.fixture(scope="module")
def url(llm: AsyncLLM) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(build_app(llm, "tiny"), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    server.should_exit = True
    thread.join(30)


def _body(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "ignore_eos": True, **kw}


def test_engine_error_fails_only_that_request(url: str) -> None:
    resp = httpx.post(url + "/completions", json=_body([5, POISON, 6]), timeout=60)
    assert resp.status_code == 500
    validate(resp.json(), "ErrorResponse")
    assert "injected device fault" in resp.json()["error"]["message"]

    ok = httpx.post(url + "/completions", json=_body([5, 6, 7]), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200


def test_a_slow_reader_gets_the_tokens_before_the_failure(llm: AsyncLLM) -> None:
    """Outputs that queue up behind a slow reader are merged, but never into the failure: a
    stream's tokens come first whatever the timing, so a stream that began stays begun."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run() -> list[RequestOutput]:
        outs = []
        async for out in llm.generate([POISON, 11], params, coalesce=True):
            outs.append(out)
            if len(outs) == 1:
                await asyncio.sleep(0.5)  # the engine fails the request meanwhile
        return outs

    outs = asyncio.run(run())
    assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)
    assert sum(len(o.new_token_ids) for o in outs[:-1]) == FAIL_AT_OUTPUT
    failure = outs[-1]
    assert failure.finish_reason == "error" and "injected device fault" in (failure.error or "")
    assert failure.new_token_ids == [] and len(failure.token_ids) == FAIL_AT_OUTPUT


def test_engine_error_mid_stream_is_an_error_event(url: str) -> None:
    events: list[Any] = []
    with httpx.stream("POST", url + "/completions", json=_body([POISON, 9], stream=True),
                      timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    assert events[-1] == "[DONE]"
    error = events[-2]
    validate(error, "ErrorResponse")
    assert "injected device fault" in error["error"]["message"]
    assert all("choices" in e for e in events[:-2]) and len(events) > 2

    chat = httpx.post(url + "/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text


def test_engine_error_in_a_streamed_batch_ends_the_stream(url: str, llm: AsyncLLM) -> None:
    """A prompt of a streamed batch fails (its iteration fails the others with it): every
    choice that had not finished gets an abort finish, then the usage, the error event and
    [DONE]; nothing is left running."""
    body = _body([[5, 6, 7], [POISON, 9], [8, 9, 10]], stream=True, max_tokens=1500,
                 stream_options={"include_usage": True})
    events: list[Any] = []
    with httpx.stream("POST", url + "/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    *chunks, usage, error, done = events
    assert done == "[DONE]" and "injected device fault" in error["error"]["message"]
    finishes = {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"]
                if c["finish_reason"] is not None}
    assert finishes == {0: "abort", 1: "abort", 2: "abort"}
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 3 + 2 + 3
    deadline = time.monotonic() + 10
    while llm.engine.has_unfinished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished


def test_engine_error_mid_response_stream_fails_the_response(url: str) -> None:
    """The Responses API's stream: an `error` event, then `response.failed` with the error."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    events: list[dict[str, Any]] = []
    body = {"model": "tiny", "input": "Hi!", "max_output_tokens": 8, "stream": True}
    with httpx.stream("POST", url + "/responses", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(TypeAdapter(ResponseStreamEvent).validate_python(
                    json.loads(line[6:])).model_dump())
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert "injected device fault" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "injected device fault" in failed["error"]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_engine_error_fails_a_background_response(url: str) -> None:
    """A background response the engine fails: stored as `failed` with the error, its
    events replayed ending in `error` and `response.failed`; the server serves on."""
    # Instructions of its own: no block of an earlier test's prompt is cached (the poison
    # is seen only in the tokens a prefill computes).
    body = {"model": "tiny", "input": "Hi!", "instructions": "In the background.",
            "max_output_tokens": 8, "background": True}
    started = httpx.post(url + "/responses", json=body, timeout=60)
    assert started.status_code == 200 and started.json()["status"] == "queued"
    response_id = started.json()["id"]
    deadline = time.monotonic() + 60
    while (now := httpx.get(f"{url}/responses/{response_id}", timeout=60).json())["status"] in (
            "queued", "in_progress"):
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    assert now["status"] == "failed" and "injected device fault" in now["error"]["message"]
    with httpx.stream("GET", f"{url}/responses/{response_id}", params={"stream": "true"},
                      timeout=60) as resp:
        kinds = [json.loads(line[6:])["type"] for line in resp.iter_lines()
                 if line.startswith("data: ")]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
    ok = httpx.post(url + "/completions", json=_body([5, 6, 7]), timeout=60)
    assert ok.status_code == 200
