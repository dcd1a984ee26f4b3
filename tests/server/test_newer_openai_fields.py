"""Fields the current OpenAI SDK sends that change nothing here are accepted, through the SDK
itself: `prompt_cache_key`, `prompt_cache_retention`, `safety_identifier` (chat, completions,
the Responses API, which echoes the key and the identifier), the Responses API's
`stream_options.include_obfuscation`; chat's `verbosity` only at medium (it would change the
answer), else a 400 naming it. `service_tier` orders the requests as the scheduler's priority
does: `priority` before the default tier, `flex` after it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.helpers import ServerProcess, managed, start_server

MODEL = "tiny"
NEWER = {"prompt_cache_key": "tenant-7", "prompt_cache_retention": "in_memory",
         "safety_identifier": "user-hash-1"}


def test_chat_and_completions_take_them(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3,
        verbosity="medium", **NEWER)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    done = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3,
                                     extra_body=NEWER)
    assert done.usage is not None and done.usage.completion_tokens == 3


def test_the_responses_api_takes_and_echoes_them(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, **NEWER)  # type: ignore[arg-type]
    assert resp.prompt_cache_key == "tenant-7" and resp.safety_identifier == "user-hash-1"
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, stream=True,
                                          stream_options={"include_obfuscation": False}))
    last = events[-1]
    assert last.type == "response.incomplete"  # cut at max_output_tokens
    assert last.response.usage is not None and last.response.usage.output_tokens == 3


def test_verbosity_other_than_medium_is_refused(server: ServerProcess) -> None:
    resp = httpx.post(server.v1 + "/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "verbosity": "low"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "verbosity"


@pytest.fixture(scope="module")
def one_at_a_time(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    yield from managed(start_server(server_tmp, "--served-model-name", MODEL, "--no-warmup",
                                    "--no-startup-profile", "--max-batch-size", "1",
                                    "--scheduler", "fcfs"))


def _long_stream(server: ServerProcess, tier: str, started: threading.Event) -> float:
    """Stream a long completion in `tier`; the time its last token came."""
    with httpx.stream("POST", server.v1 + "/completions", timeout=300, json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
            "stream": True, "service_tier": tier}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                started.set()
    return time.monotonic()


@pytest.mark.parametrize(("running", "arriving", "arriving_first"), [
    ("flex", "default", True),  # the default tier runs before flex: it preempts it
    ("default", "priority", True),
    ("default", "flex", False),  # flex waits for the default tier
])
def test_service_tier_orders_the_requests(one_at_a_time: ServerProcess, running: str,
                                          arriving: str, arriving_first: bool) -> None:
    """One request at a time: a request of a higher tier arriving while a long one runs ends
    first (it preempts it between tokens); one of a lower tier waits for it to end."""
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        long_done = pool.submit(_long_stream, one_at_a_time, running, started)
        assert started.wait(120)
        short = httpx.post(one_at_a_time.v1 + "/completions", timeout=300, json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True,
            "service_tier": arriving})
        short_done = time.monotonic()
        assert short.status_code == 200, short.text
        assert (short_done < long_done.result()) == arriving_first


def test_service_tier_and_priority_are_not_both_given(server: ServerProcess) -> None:
    resp = httpx.post(server.v1 + "/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "priority": 3, "service_tier": "flex"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "service_tier"
    tiered = httpx.post(server.v1 + "/responses", timeout=60, json={
        "model": MODEL, "input": "Hi", "max_output_tokens": 2, "service_tier": "flex"})
    assert tiered.status_code == 200 and tiered.json()["service_tier"] == "flex"
