"""A batch of prompts in one completions request (OpenAI's `prompt` as a list; lm-eval's
local-completions sends them so): each prompt runs as its own request, and the response lists
each prompt's `n` choices in turn, as a request per prompt would have answered them; streamed,
the choices' chunks come as they are made, in one stream."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.server.helpers import ServerProcess, validate

MODEL = "tiny"
PROMPTS: list[Any] = ["Once upon a time", [5, 17, 99, 3, 42], "The capital of France is"]
GREEDY = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def complete(server: ServerProcess, **body: Any) -> httpx.Response:
    return httpx.post(server.v1 + "/completions", json={**GREEDY, **body}, timeout=120)


def test_a_batch_answers_as_a_request_per_prompt(server: ServerProcess) -> None:
    batch = complete(server, prompt=PROMPTS)
    assert batch.status_code == 200, batch.text
    validate(batch.json(), "CreateCompletionResponse")
    singles = [complete(server, prompt=p).json() for p in PROMPTS]
    assert [c["index"] for c in batch.json()["choices"]] == [0, 1, 2]
    assert [c["text"] for c in batch.json()["choices"]] == [s["choices"][0]["text"] for s in singles]
    usage = batch.json()["usage"]
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["completion_tokens"] == 3 * 6 and usage["total_tokens"] == usage["prompt_tokens"] + 18


def test_each_prompts_n_choices_come_in_turn(server: ServerProcess) -> None:
    resp = complete(server, prompt=PROMPTS[:2], n=2, seed=7, temperature=1.0, echo=True)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["text"].startswith("Once upon a time") for c in choices[:2])
    assert not any(c["text"].startswith("Once upon a time") for c in choices[2:])


def test_lm_eval_loglikelihood_batch(server: ServerProcess) -> None:
    """What lm-eval's local-completions sends to score continuations: echo, logprobs, and
    one token (or none) to generate, for a batch of contexts."""
    texts = ["The quick brown fox", "jumps over the lazy dog"]
    batch = complete(server, prompt=texts, max_tokens=0, echo=True, logprobs=1)
    assert batch.status_code == 200, batch.text
    for text, choice in zip(texts, batch.json()["choices"], strict=True):
        single = complete(server, prompt=text, max_tokens=0, echo=True, logprobs=1).json()["choices"][0]
        assert choice["text"] == text == single["text"]
        assert choice["logprobs"]["tokens"] == single["logprobs"]["tokens"]
        got, want = choice["logprobs"]["token_logprobs"], single["logprobs"]["token_logprobs"]
        assert got[0] is None and want[0] is None  # the first token has no context
        # NOTE: up to float32 sums in another order: a batch's matmuls are of another shape
        # (MKL's float32 GEMM on an AMX Xeon put them 1.2e-6 apart, relative).
        assert got[1:] == pytest.approx(want[1:], rel=1e-5)


def test_the_openai_client_sends_a_batch(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=["a b c", "d e f"], max_tokens=3)
    assert len(resp.choices) == 2 and resp.usage is not None and resp.usage.completion_tokens <= 6


def test_a_bad_prompt_in_a_batch_is_named(server: ServerProcess) -> None:
    max_model_len = httpx.get(server.v1 + "/models").json()["data"][0]["max_model_len"]
    resp = complete(server, prompt=["fine", [7] * max_model_len])
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "prompt[1]" and error["code"] == "context_length_exceeded"
    assert error["message"].startswith("prompt[1]:")


def test_a_batch_may_not_queue_thousands_of_sequences(server: ServerProcess) -> None:
    resp = complete(server, prompt=["hi"] * 128, n=9)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "prompt" and "1152" in resp.json()["error"]["message"]


def stream(server: ServerProcess, **body: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """A stream's chunks, and its lines after the last chunk."""
    chunks: list[dict[str, Any]] = []
    tail: list[str] = []
    with httpx.stream("POST", server.v1 + "/completions", timeout=120,
                      json={**GREEDY, "stream": True, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
            elif line.startswith("data: "):
                tail.append(line)
    return chunks, tail


@pytest.mark.parametrize("extra", [{}, {"echo": True, "logprobs": 2, "return_token_ids": True},
                                   {"n": 2, "seed": 11, "temperature": 1.0}])
def test_a_streamed_batch_adds_up_to_the_whole_batch(server: ServerProcess, extra: dict[str, Any]) -> None:
    whole = complete(server, prompt=PROMPTS, **extra).json()
    chunks, tail = stream(server, prompt=PROMPTS, stream_options={"include_usage": True}, **extra)
    assert tail == ["data: [DONE]"]
    assert len({c["id"] for c in chunks}) == 1 and len(chunks[0]["id"]) == len(whole["id"])
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    tokens: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        tokens.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
        if choice["finish_reason"] is not None:
            finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finishes == {c["index"]: [c["finish_reason"]] for c in whole["choices"]}
    if extra.get("return_token_ids"):
        assert tokens == {c["index"]: c["token_ids"] for c in whole["choices"]}
    usage = chunks[-1]
    assert usage["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage["usage"][field] == whole["usage"][field]


def test_the_openai_client_streams_a_batch(client: openai.OpenAI) -> None:
    texts = ["", ""]
    for chunk in client.completions.create(model=MODEL, prompt=["a b c", [5, 17, 99]],
                                           max_tokens=4, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    whole = client.completions.create(model=MODEL, prompt=["a b c", [5, 17, 99]], max_tokens=4,
                                      temperature=0)
    assert all(texts) and len(whole.choices) == 2


def test_leaving_a_streamed_batch_aborts_every_prompt(server: ServerProcess) -> None:
    aborted = 'fastserve_requests_finished_total{finish_reason="abort"}'
    before = server.metrics().get(aborted, 0.0)
    body = {"prompt": PROMPTS, "max_tokens": 1500}  # no prompt ends before the client goes
    with httpx.stream("POST", server.v1 + "/completions", timeout=60,
                      json={**GREEDY, "stream": True, **body}) as resp:
        indices: set[int] = set()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                indices |= {c["index"] for c in json.loads(line[6:])["choices"]}
            if len(indices) == len(PROMPTS):
                break
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        if m[aborted] == before + len(PROMPTS) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m[aborted] == before + len(PROMPTS)
    assert m["fastserve_requests_running"] == 0 and m["fastserve_requests_waiting"] == 0
