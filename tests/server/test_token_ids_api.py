"""vLLM's `return_token_ids`: the prompt's and the output's token ids in the response, what RL
trainers read instead of re-tokenizing text. Streamed, the prompt's come in the first chunk
and each chunk carries its new tokens, so that a stream's ids add up to the whole response's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from fastserve.model.tokenizer import Tokenizer
from tests.server.helpers import ServerProcess, validate

MODEL = "tiny"
PROMPT = [5, 17, 99, 3, 42, 8]
MESSAGES = [{"role": "user", "content": "Count to three."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_ready: Path) -> Tokenizer:
    return Tokenizer(tiny_model_ready)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(server.v1 + path, json={"model": MODEL, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream(server: ServerProcess, path: str, body: dict[str, Any], schema: str | None = None
           ) -> list[dict[str, Any]]:
    """The stream's chunks (checked against `schema`: OpenAI's has none for completion chunks,
    whose finish_reason is null until the end)."""
    chunks = []
    with httpx.stream("POST", server.v1 + path, timeout=120,
                      json={"model": MODEL, "stream": True, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if schema is not None:
                    validate(chunks[-1], schema)
    return chunks


@pytest.mark.parametrize("extra", [{}, {"n": 2, "seed": 3, "temperature": 1.0},
                                   {"echo": True, "logprobs": 1}])
def test_completions_return_the_token_ids(server: ServerProcess, tokenizer: Tokenizer,
                                          extra: dict[str, Any]) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True,
            "temperature": 0, **extra}
    whole = post(server, "/completions", body)
    if not extra.get("echo"):  # echo's first token has no log-probability: OpenAI's schema says none
        validate(whole, "CreateCompletionResponse")
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == PROMPT
        assert len(choice["token_ids"]) == 12
        assert choice["text"].endswith(tokenizer.decode(choice["token_ids"]))
    assert whole["usage"]["completion_tokens"] == 12 * len(whole["choices"])

    chunks = stream(server, "/completions", body)
    for choice in whole["choices"]:
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == choice["index"]]
        assert mine[0]["prompt_token_ids"] == PROMPT
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]


def test_chat_returns_the_token_ids(server: ServerProcess, tokenizer: Tokenizer) -> None:
    body = {"messages": MESSAGES, "max_tokens": 10, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}
    whole = post(server, "/chat/completions", body)
    validate(whole, "CreateChatCompletionResponse")
    (choice,) = whole["choices"]
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == 10
    assert tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]

    chunks = stream(server, "/chat/completions", body, "CreateChatCompletionStreamResponse")
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == choice["token_ids"]


def test_tokens_held_back_by_the_tool_parser_still_come(server: ServerProcess) -> None:
    """A forced call's tokens arrive before the parser sends anything (its tag's start): each
    output's ids still come, in a chunk of their own if need be."""
    pytest.importorskip("xgrammar")
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}}}
    body = {"messages": MESSAGES, "max_tokens": 40, "tools": [tool], "tool_choice": "required",
            "parallel_tool_calls": False, "return_token_ids": True, "seed": 0}
    whole = post(server, "/chat/completions", body)["choices"][0]
    chunks = stream(server, "/chat/completions", body, "CreateChatCompletionStreamResponse")
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == whole["token_ids"]
    assert whole["message"]["tool_calls"][0]["function"]["name"] == "f"


def test_no_token_ids_unless_asked(server: ServerProcess) -> None:
    whole = post(server, "/chat/completions", {"messages": MESSAGES, "max_tokens": 3})
    assert "prompt_token_ids" not in whole and "token_ids" not in whole["choices"][0]
    chunks = stream(server, "/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1})
    assert not any("token_ids" in c or "prompt_token_ids" in c for ch in chunks for c in ch["choices"])


def test_add_special_tokens_false_reads_the_prompt_without_bos(server: ServerProcess,
                                                               tokenizer: Tokenizer) -> None:
    """vLLM's completions extension: a prompt that already holds what the model must read
    (say, a rendered chat) is read as it is."""
    text = "Count to three."
    assert tokenizer.bos_token_id is not None
    with_bos = tokenizer.encode(text)
    assert with_bos[0] == tokenizer.bos_token_id  # the tiny model's tokenizer adds one
    body = {"prompt": text, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    default = post(server, "/completions", body)
    bare = post(server, "/completions", {**body, "add_special_tokens": False})
    assert default["choices"][0]["prompt_token_ids"] == with_bos
    assert bare["choices"][0]["prompt_token_ids"] == with_bos[1:]
    assert bare["usage"]["prompt_tokens"] == default["usage"]["prompt_tokens"] - 1
