"""The OpenAI-compatible API of one real `fastserve serve` process, driven by the `openai` client.

Responses and stream chunks are checked against the OpenAI API reference's JSON schemas
(openai_schemas.json). The key comes from FASTSERVE_API_KEY, so that path is covered too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import TEST_DTYPE
from tests.server.helpers import ServerProcess, managed, start_server, validate

API_KEY = "sk-fastserve-test"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    yield from managed(
        start_server(server_tmp, "--max-batch-size", "32", env={"FASTSERVE_API_KEY": API_KEY})
    )


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def max_model_len(server: ServerProcess) -> int:
    return int(httpx.get(server.v1 + "/models", headers=AUTH).json()["data"][0]["max_model_len"])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_ready: Path) -> Any:
    from fastserve.model.tokenizer import Tokenizer

    return Tokenizer(tiny_model_ready)


def post(server: ServerProcess, path: str, body: Any, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(server.v1 + path, content=content, headers=headers, timeout=120, **kw)


def sse_events(server: ServerProcess, path: str, body: dict[str, Any]) -> list[Any]:
    """POST with stream=true; the decoded `data:` payloads, with "[DONE]" kept as a string."""
    events: list[Any] = []
    with httpx.stream("POST", server.v1 + path, json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def error_of(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    validate(body, "ErrorResponse")
    return body["error"]


# -- models, health, docs ---------------------------------------------------------------------


def test_models_health_and_openapi(server: ServerProcess) -> None:
    models = httpx.get(server.v1 + "/models", headers=AUTH).json()
    validate(models, "ListModelsResponse")
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(paths)


# -- completions ------------------------------------------------------------------------------


def test_completion_schema_and_usage(server: ServerProcess) -> None:
    ids = list(range(10, 30))
    resp = post(server, "/completions", {"model": MODEL, "prompt": ids, "max_tokens": 7,
                                         "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    validate(body, "CreateCompletionResponse")
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_usage_reports_cached_prompt_tokens_and_metrics_count_them(server: ServerProcess) -> None:
    def metric(text: str, name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    before = httpx.get(server.url + "/metrics").text
    ids = list(range(300, 340))  # 40 tokens: two full 16-token blocks, then 8
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "ignore_eos": True}
    first = post(server, "/completions", body).json()["usage"]
    again = post(server, "/completions", body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["prompt_tokens_details"] == {"cached_tokens": 32}
    after = httpx.get(server.url + "/metrics").text
    hits = "fastserve_prefix_cache_hits_total"
    queries = "fastserve_prefix_cache_queries_total"
    assert metric(after, hits) - metric(before, hits) == 32
    assert metric(after, queries) - metric(before, queries) == 80
    assert metric(after, 'fastserve_prefix_cache_blocks{tier="device"}') >= 2


@pytest.mark.parametrize("path", ["/completions", "/chat/completions", "/responses"])
def test_cache_salt_keeps_cached_prefixes_apart(server: ServerProcess, path: str) -> None:
    """vLLM's `cache_salt`: a prompt's cached blocks are found again only under its salt."""
    text = " ".join(f"{path} salted words {i}" for i in range(12))  # several full blocks
    body: dict[str, Any] = {"model": MODEL}
    if path == "/completions":
        body.update(prompt=text, max_tokens=2)
    elif path == "/chat/completions":
        body.update(messages=[{"role": "user", "content": text}], max_tokens=2)
    else:
        body.update(input=text, max_output_tokens=2, store=False)

    def cached(salt: str | None) -> int:
        resp = post(server, path, {**body, "cache_salt": salt} if salt else body)
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        return int(details["cached_tokens"])

    assert cached("alice") == 0
    assert cached("alice") > 0
    assert cached("bob") == 0  # another salt finds none of alice's blocks
    assert cached(None) == 0  # nor does a request without one
    assert cached(None) > 0
    resp = post(server, path, {**body, "cache_salt": ""})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text


def test_completion_with_openai_client(client: openai.OpenAI, tokenizer: Any) -> None:
    prompt = "The quick brown fox"
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.object == "text_completion" and done.model == MODEL
    assert isinstance(done.choices[0].text, str) and done.choices[0].text
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert done.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert done.usage.completion_tokens == 8
    assert done.usage.total_tokens == done.usage.prompt_tokens + 8


def test_streaming_completion_matches_non_streaming(server: ServerProcess, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    full = post(server, "/completions", body).json()
    events = sse_events(server, "/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        validate(chunk, "CreateCompletionStreamResponse")
    *text_chunks, usage_chunk = chunks
    # (the stream may find the prompt cached by the first request: cached_tokens may differ)
    assert usage_chunk["choices"] == []
    assert {k: v for k, v in usage_chunk["usage"].items() if k != "prompt_tokens_details"} \
        == {k: v for k, v in full["usage"].items() if k != "prompt_tokens_details"}
    assert all(c["usage"] is None for c in text_chunks)
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == full["choices"][0]["text"]
    assert len({c["id"] for c in chunks}) == 1

    # The same through the openai client; without include_usage there is no usage key at all.
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    parts = list(stream)
    assert "".join(p.choices[0].text for p in parts) == full["choices"][0]["text"]
    assert all(p.usage is None for p in parts)


def test_stop_sequences(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "It was a dark and stormy night",
                          "max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}
    base = client.completions.create(**kw).choices[0].text
    stop = next(base[i:i + 2] for i in range(8, len(base) - 2) if base[i:i + 2].strip())
    cut = base.find(stop)
    for stop_arg in (stop, [stop, "\x00never"]):
        done = client.completions.create(**kw, stop=stop_arg)
        assert done.choices[0].text == base[:cut]
        assert done.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**kw, stop=stop, stream=True)
    parts = list(streamed)
    assert "".join(p.choices[0].text for p in parts) == base[:cut]
    assert parts[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=1.0,
                                         top_p=0.95, seed=seed, extra_body={"ignore_eos": True})
        return done.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first  # the seed is used, not ignored


# -- chat ---------------------------------------------------------------------------------------

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
]


def test_chat_completion(server: ServerProcess, client: openai.OpenAI) -> None:
    resp = post(server, "/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 6,
                                              "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    validate(body, "CreateChatCompletionResponse")
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 6

    done = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                          max_completion_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert done.object == "chat.completion"
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 5
    assert done.usage.prompt_tokens == body["usage"]["prompt_tokens"]


def test_chat_streaming(server: ServerProcess, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    full = post(server, "/chat/completions", body).json()
    events = sse_events(server, "/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    for chunk in [*chunks, usage_chunk]:
        validate(chunk, "CreateChatCompletionStreamResponse")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    # (the stream may find the prompt cached by the first request: cached_tokens may differ)
    assert usage_chunk["choices"] == []
    assert {k: v for k, v in usage_chunk["usage"].items() if k != "prompt_tokens_details"} \
        == {k: v for k, v in full["usage"].items() if k != "prompt_tokens_details"}

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                            max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    parts = list(stream)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == text
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 10


def test_harmless_fields_accepted(server: ServerProcess) -> None:
    extras = {"user": "u-1", "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
              "stream": False, "logit_bias": {}, "top_p": 0.9, "temperature": 0.7}
    resp = post(server, "/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2,
                                         "echo": False, "best_of": 1, "logprobs": None, **extras})
    assert resp.status_code == 200, resp.text
    resp = post(server, "/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                              "logprobs": False, "tool_choice": "none",
                                              "response_format": {"type": "text"}, **extras})
    assert resp.status_code == 200, resp.text
    resp = post(server, "/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                              "priority": -5})
    assert resp.status_code == 200, resp.text


# -- bad input ----------------------------------------------------------------------------------

CHAT = "/chat/completions"
CMPL = "/completions"


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CMPL, {"max_tokens": "5"}, "max_tokens"),
        (CMPL, {"temperature": "hot"}, "temperature"),
        (CMPL, {"prompt": 5}, "prompt"),
        (CMPL, {"prompt": ["a"] * 129}, "prompt"),
        (CMPL, {"prompt": ["a", [1, 2**40]]}, "prompt[1]"),
        (CMPL, {"prompt": ""}, "prompt"),
        (CMPL, {"stop": 3}, "stop"),
        (CMPL, {"seed": "x"}, "seed"),
        (CMPL, {"max_tokens": 0}, "max_tokens"),
        (CMPL, {"max_tokens": -3}, "max_tokens"),
        (CMPL, {"temperature": 2.5}, "temperature"),
        (CMPL, {"top_p": 0}, "top_p"),
        (CMPL, {"prompt": [1, 2, 10**9]}, "prompt"),
        (CMPL, {"n": 0}, "n"),
        (CMPL, {"logprobs": 21}, "logprobs"),
        (CMPL, {"n": 2, "best_of": 1}, "best_of"),
        (CMPL, {"suffix": "end"}, "suffix"),
        (CMPL, {"echo": "yes"}, "echo"),
        (CMPL, {"logit_bias": {"5": 500}}, "logit_bias"),
        (CMPL, {"presence_penalty": 2.5}, "presence_penalty"),
        (CMPL, {"frobnicate": 1}, "frobnicate"),
        (CMPL, {"stream_options": {"include_usage": True}}, "stream_options"),
        (CMPL, {"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content"),
        (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
        (CHAT, {"n": 200}, "n"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
        (CHAT, {"tool_choice": "required"}, "tool_choice"),
        (CHAT, {"functions": [{"name": "f g"}]}, "functions[0].name"),
        (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"suffix": "x"}, "suffix"),
        (CMPL, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        (CHAT, {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        (CMPL, {"priority": "high"}, "priority"),
        (CHAT, {"priority": 2**31}, "priority"),
    ],
)
def test_bad_field_is_400_naming_it(server: ServerProcess, path: str, fields: dict[str, Any], param: str) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 4}
    base.update({"prompt": "hello"} if path == CMPL else {"messages": MESSAGES})
    resp = post(server, path, {**base, **fields})
    assert resp.status_code == 400, resp.text
    err = error_of(resp)
    assert err["param"] == param
    assert param.split("[")[0] in err["message"]
    assert err["type"] == "invalid_request_error"


def test_context_limits(server: ServerProcess, max_model_len: int, client: openai.OpenAI) -> None:
    too_long = post(server, CMPL, {"model": MODEL, "prompt": [7] * max_model_len, "max_tokens": 1})
    assert too_long.status_code == 400
    assert error_of(too_long)["param"] == "prompt" and "context" in error_of(too_long)["message"]
    over = post(server, CMPL, {"model": MODEL, "prompt": [7] * 10, "max_tokens": max_model_len})
    assert over.status_code == 400 and error_of(over)["param"] == "max_tokens"
    chat = post(server, CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": max_model_len})
    assert chat.status_code == 400 and error_of(chat)["param"] == "max_tokens"
    long_chat = [{"role": "user", "content": "word " * (2 * max_model_len)}]
    resp = post(server, CHAT, {"model": MODEL, "messages": long_chat})
    assert resp.status_code == 400 and error_of(resp)["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.completions.create(model=MODEL, prompt=[7] * max_model_len, max_tokens=1)
    assert "prompt" in exc_info.value.message
    # Just inside the limit is fine.
    ok = post(server, CMPL, {"model": MODEL, "prompt": [7] * (max_model_len - 2), "max_tokens": 2,
                             "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2


def test_truncate_prompt_tokens_keeps_the_prompts_end(server: ServerProcess, max_model_len: int) -> None:
    """vLLM's extension: the model reads only the prompt's last k tokens (-1: as many as leave
    room for max_tokens), and says so in usage and echo."""
    prompt = [(7 * i) % 200 + 3 for i in range(40)]
    greedy = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cut = post(server, CMPL, {**greedy, "prompt": prompt, "truncate_prompt_tokens": 8, "echo": True})
    alone = post(server, CMPL, {**greedy, "prompt": prompt[-8:], "echo": True})
    assert cut.status_code == 200 and alone.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 8
    assert cut.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    # truncation_side right: the prompt's first k tokens.
    head = post(server, CMPL, {**greedy, "prompt": prompt, "truncate_prompt_tokens": 8,
                               "truncation_side": "right"})
    head_alone = post(server, CMPL, {**greedy, "prompt": prompt[:8]})
    assert head.status_code == 200, head.text
    assert head.json()["usage"]["prompt_tokens"] == 8
    assert head.json()["choices"][0]["text"] == head_alone.json()["choices"][0]["text"]
    untouched = post(server, CMPL, {**greedy, "prompt": prompt, "truncate_prompt_tokens": 100})
    assert untouched.json()["usage"]["prompt_tokens"] == len(prompt)

    fit = post(server, CMPL, {**greedy, "prompt": [7] * (max_model_len + 50), "max_tokens": 5,
                              "truncate_prompt_tokens": -1})
    assert fit.status_code == 200, fit.text
    usage = fit.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (max_model_len - 5, 5)
    long_chat = [{"role": "user", "content": "word " * (2 * max_model_len)}]
    chat = post(server, CHAT, {"model": MODEL, "messages": long_chat, "max_completion_tokens": 3,
                               "truncate_prompt_tokens": -1})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == max_model_len - 3
    # A cut that still leaves no room is the usual context error.
    over = post(server, CMPL, {**greedy, "prompt": [7] * max_model_len, "truncate_prompt_tokens": max_model_len})
    assert over.status_code == 400 and error_of(over)["code"] == "context_length_exceeded"


def test_skip_special_tokens_false_keeps_them_in_the_text(server: ServerProcess, tokenizer: Any) -> None:
    """vLLM's extension: the EOS token (pushed by logit_bias, ignore_eos) is text only when
    asked for, streamed or not."""
    eos = tokenizer.eos_token_ids[0]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True, "temperature": 0,
            "logit_bias": {str(eos): 100}}
    dropped = post(server, CMPL, body).json()["choices"][0]["text"]
    kept = post(server, CMPL, {**body, "skip_special_tokens": False}).json()["choices"][0]["text"]
    assert (dropped, kept) == ("", tokenizer.eos_token * 3)
    streamed = sse_events(server, CMPL, {**body, "skip_special_tokens": False})
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1] if e["choices"]) == kept


def test_the_fleet_router_reads_the_truncated_prompt(tokenizer: Any) -> None:
    """`--replicas N` routes by the prompt the replica runs: the truncated one."""
    pytest.importorskip("ray")
    from fastserve.cluster.ingress import RouteHints

    hints = RouteHints(tokenizer, block_size=16)
    body = {"model": MODEL, "prompt": list(range(3, 43)), "truncate_prompt_tokens": 8}
    routed = asyncio.run(hints.route("/v1/completions", json.dumps(body).encode()))
    assert routed is not None and routed.num_prompt_tokens == 8
    # Its blocks' hashes are those of the tokens kept: the last 8, or the first with "right".
    head = asyncio.run(hints.route("/v1/completions", json.dumps(
        {**body, "truncate_prompt_tokens": 16, "truncation_side": "right"}).encode()))
    tail = asyncio.run(hints.route("/v1/completions", json.dumps(
        {**body, "truncate_prompt_tokens": 16}).encode()))
    first = asyncio.run(hints.route("/v1/completions", json.dumps(
        {"model": MODEL, "prompt": list(range(3, 19))}).encode()))
    assert head is not None and tail is not None and first is not None
    assert head.block_hashes == first.block_hashes != tail.block_hashes


def test_malformed_json(server: ServerProcess) -> None:
    for raw in (b'{"model": "tiny", "prompt": ', b"[1, 2]", b"not json at all"):
        resp = post(server, CMPL, raw)
        assert resp.status_code == 400, resp.text
        assert error_of(resp)["type"] == "invalid_request_error"
    assert "JSON" in error_of(post(server, CMPL, b"{oops"))["message"]
    missing = post(server, CMPL, {"prompt": "hi"})
    assert missing.status_code == 400 and error_of(missing)["param"] == "model"


def test_unknown_model_404(server: ServerProcess, client: openai.OpenAI) -> None:
    for path, extra in ((CMPL, {"prompt": "hi"}), (CHAT, {"messages": MESSAGES})):
        resp = post(server, path, {"model": "gpt-17", **extra})
        assert resp.status_code == 404
        err = error_of(resp)
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "gpt-17" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="hi")


# -- security -----------------------------------------------------------------------------------


def test_api_key_required(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
        for resp in (
            httpx.get(server.v1 + "/models", headers=headers),
            httpx.post(server.v1 + CMPL, json={"model": MODEL, "prompt": "hi"}, headers=headers),
            httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, headers=headers),
            httpx.post(server.url + "/detokenize", json={"tokens": [5]}, headers=headers),
        ):
            assert resp.status_code == 401, resp.text
            assert error_of(resp)["code"] == "invalid_api_key"
    # Checked before the body is even parsed, and on every /v1 path.
    for raw in (b"{not json", b'{"model": "tiny", "prompt": "hi", "frobnicate": 1}'):
        assert post(server, CMPL, raw, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(server.v1 + "/no-such-route").status_code == 401
    assert httpx.get(server.v1 + "/no-such-route", headers=AUTH).status_code == 404
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, headers=AUTH).status_code == 200
    for key in ("wrong-key", API_KEY + "x"):
        bad = openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    # Health and metrics stay open (probes and scrapers carry no key).
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_huge_body_413(server: ServerProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as exc_info:
        client.completions.create(model=MODEL, prompt="x" * (1 << 20), max_tokens=1)
    assert exc_info.value.status_code == 413
    declared = post(server, CMPL, b"{" + b" " * (2 << 20) + b"}")
    assert declared.status_code == 413 and error_of(declared)["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the streamed size is counted
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'

    before = server.metrics().get('fastserve_http_errors_total{status="413"}', 0.0)
    resp = httpx.post(server.v1 + CMPL, content=chunked(), headers=AUTH, timeout=60)
    assert resp.status_code == 413
    assert server.metrics()['fastserve_http_errors_total{status="413"}'] == before + 1
    assert httpx.get(server.url + "/health").status_code == 200


def test_huge_body_413_reaches_async_clients(server: ServerProcess) -> None:
    """Asynchronous clients write the whole body before they read: the 413 must wait for them
    (a connection closed with the body unread resets, and they would see no response)."""
    body = {"model": MODEL, "prompt": "x" * (2 << 20), "max_tokens": 1}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.v1, headers=AUTH, timeout=60) as http:
            for _ in range(3):
                resp = await http.post(CMPL, json=body)
                assert resp.status_code == 413 and error_of(resp)["code"] == "request_too_large"
            ok = await http.post(CMPL, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200  # the connection is still good for the next request
        client = openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=60)
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as exc_info:
                await client.completions.create(model=MODEL, prompt="x" * (2 << 20), max_tokens=1)
            assert exc_info.value.status_code == 413
        await client.close()

    asyncio.run(run())


# -- disconnects, concurrency, metrics ----------------------------------------------------------


def test_client_disconnect_aborts_and_frees_blocks(server: ServerProcess, max_model_len: int) -> None:
    aborted = 'fastserve_requests_finished_total{finish_reason="abort"}'
    before = server.metrics().get(aborted, 0.0)
    body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": max_model_len - 16,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.v1 + CMPL, json=body, headers=AUTH, timeout=60) as resp:
        lines = resp.iter_lines()
        got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert got, "no chunk before the disconnect"
        running = server.metrics()
        assert running["fastserve_requests_running"] == 1
        assert running["fastserve_kv_blocks_free"] < running["fastserve_kv_blocks_total"]
    # Leaving the block closed the connection mid-stream.
    t0 = time.monotonic()
    m = server.wait_idle()
    assert m["fastserve_requests_running"] == 0
    assert m["fastserve_kv_blocks_free"] == m["fastserve_kv_blocks_total"]
    assert m[aborted] == before + 1
    assert time.monotonic() - t0 < 5.0

    # A non-streaming request whose client times out is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.v1 + CMPL, json={**body, "stream": False}, headers=AUTH, timeout=0.5)
    m = server.wait_idle()
    assert m["fastserve_kv_blocks_free"] == m["fastserve_kv_blocks_total"]
    assert m[aborted] == before + 2


def test_200_concurrent_streams(server: ServerProcess) -> None:
    async def one(http: httpx.AsyncClient, i: int) -> tuple[str | None, int, bool]:
        body = {"model": MODEL, "prompt": f"Request number {i} says", "max_tokens": 6,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        finish, tokens, done = None, 0, False
        async with http.stream("POST", server.v1 + CMPL, json=body, headers=AUTH) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    if chunk["choices"]:
                        finish = chunk["choices"][0]["finish_reason"] or finish
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        return finish, tokens, done

    async def run_all() -> list[tuple[str | None, int, bool]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(limits=limits, timeout=300) as http:
            return await asyncio.gather(*(one(http, i) for i in range(200)))

    results = asyncio.run(run_all())
    assert results == [("length", 6, True)] * 200
    m = server.wait_idle()
    assert m["fastserve_kv_blocks_free"] == m["fastserve_kv_blocks_total"]
    assert m["fastserve_requests_running"] == 0


def test_metrics_exposition(server: ServerProcess) -> None:
    post(server, CMPL, {"model": MODEL, "prompt": "metrics", "max_tokens": 3, "ignore_eos": True})
    post(server, CMPL, {"model": "nope", "prompt": "metrics"})
    text = httpx.get(server.url + "/metrics").text
    for name, kind in [
        ("fastserve_requests_running", "gauge"),
        ("fastserve_requests_waiting", "gauge"),
        ("fastserve_requests_swapped", "gauge"),
        ("fastserve_kv_blocks_free", "gauge"),
        ("fastserve_kv_blocks_total", "gauge"),
        ("fastserve_queue_length", "gauge"),
        ("fastserve_cost_model_ratio", "gauge"),
        ("fastserve_cost_model_scale", "gauge"),
        ("fastserve_preemptions", "counter"),
        ("fastserve_requests_finished", "counter"),
        ("fastserve_ttft_seconds", "histogram"),
        ("fastserve_jct_seconds", "histogram"),
    ]:
        # prometheus_client names a counter's family with or without `_total` by version.
        names = (name, name + "_total") if kind == "counter" else (name,)
        assert any(f"# TYPE {n} {kind}\n" in text for n in names), name
    m = server.metrics()
    assert "fastserve_preemptions_total" in m
    assert m['fastserve_requests_finished_total{finish_reason="length"}'] >= 1
    assert m["fastserve_ttft_seconds_count"] >= 1 and m["fastserve_jct_seconds_count"] >= 1
    assert m["fastserve_kv_blocks_total"] > 0
    assert m["fastserve_cost_model_ratio"] > 0  # predicted / measured iteration time
    assert m["fastserve_cost_model_scale"] > 0  # the calibration on the start-up profile
    assert m['fastserve_http_errors_total{status="404"}'] >= 1
    # The default scheduler is a multi-level queue: one gauge per level, not one for all.
    levels = {k for k in m if k.startswith("fastserve_queue_length{")}
    assert len(levels) >= 2, levels
    # What the executor chose at start-up: one info sample naming the device, the dtype asked
    # for (and why), the kernels' backend and, on CPU, the instruction set they use.
    (info,) = [k for k in m if k.startswith("fastserve_executor_info{")]
    assert m[info] == 1.0
    assert 'device="cpu"' in info and f'dtype="{TEST_DTYPE}"' in info
    assert 'dtype_reason="asked for"' in info and 'attention_backend="' in info
    if 'attention_backend="cpu"' in info:
        assert 'cpu_isa="' in info and 'weights="' in info
