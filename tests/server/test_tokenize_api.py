"""vLLM's `/tokenize` and `/detokenize`: a prompt's token ids as completions read it, a
conversation's as the chat endpoint renders it (its count is what chat bills as prompt
tokens), and token ids back to text; bad input is a 400 naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from fastserve.model.tokenizer import Tokenizer
from tests.server.helpers import ServerProcess

MODEL = "tiny"
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_ready: Path) -> Tokenizer:
    return Tokenizer(tiny_model_ready)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_a_prompt_is_tokenized_as_completions_read_it(server: ServerProcess, tokenizer: Tokenizer) -> None:
    text = "Tokenize me, please: naïve café."
    resp = post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert "token_strs" not in body
    models = httpx.get(server.v1 + "/models").json()["data"][0]
    assert body["max_model_len"] == models["max_model_len"]
    completion = httpx.post(server.v1 + "/completions", timeout=60, json={
        "model": MODEL, "prompt": text, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == body["count"]

    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                      "return_token_strs": True}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == [tokenizer.id_to_token(i) for i in bare["tokens"]]
    back = post(server, "/detokenize", {"model": MODEL, "tokens": bare["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_a_conversation_counts_what_chat_bills(server: ServerProcess) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}]
    for extra in ({}, {"tools": [TOOL]}):
        counted = post(server, "/tokenize", {"model": MODEL, "messages": messages, **extra}).json()
        chat = httpx.post(server.v1 + "/chat/completions", timeout=60, json={
            "model": MODEL, "messages": messages, "max_tokens": 1, "tool_choice": "none", **extra})
        assert chat.status_code == 200, chat.text
        assert counted["count"] == chat.json()["usage"]["prompt_tokens"]
    without_tools = post(server, "/tokenize", {"messages": messages}).json()["count"]
    assert counted["count"] > without_tools  # the tools are in the prompt
    no_opening = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert no_opening.json()["count"] < without_tools


def test_a_megabyte_of_ids_is_detokenized(server: ServerProcess, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello there, general Kenobi. " * 4000, add_special_tokens=False)
    resp = post(server, "/detokenize", {"tokens": ids})
    assert resp.status_code == 200 and resp.json()["prompt"] == "Hello there, general Kenobi. " * 4000


@pytest.mark.parametrize(("path", "body", "param", "status"), [
    ("/tokenize", {}, "prompt", 400),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages", 400),
    ("/tokenize", {"prompt": "a", "tools": [TOOL]}, "tools", 400),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True},
     "add_special_tokens", 400),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages[0].role", 400),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model", 404),
    ("/detokenize", {"tokens": [5, 10**7]}, "tokens[1]", 400),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]", 400),
    ("/detokenize", {"tokens": "5 6"}, "tokens", 400),
])
def test_bad_input_is_an_error_naming_the_field(server: ServerProcess, path: str, body: dict[str, Any],
                                               param: str, status: int) -> None:
    resp = post(server, path, body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param
