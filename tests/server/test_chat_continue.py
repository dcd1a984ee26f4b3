"""vLLM's chat extensions for how the prompt ends, on a real server: `continue_final_message`
(the assistant's last message is left open and the model continues it: a prefill),
`add_generation_prompt`, and `echo` (the response's content begins with that message). The
prompt is checked through `/tokenize`, and the continuation against the completions endpoint
fed the same prompt's token ids."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fastserve.model.tokenizer import Tokenizer
from tests.conftest import IS_EXACT_DTYPE
from tests.greedy import GreedyReference, assert_same_greedy_tokens
from tests.server.helpers import ServerProcess, chat_chunks, validate

MODEL = "tiny"
PREFILL = "The longest river in the world is"
MESSAGES: list[Any] = [{"role": "user", "content": "Which river is the longest?"},
                       {"role": "assistant", "content": PREFILL}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
# Greedy and exactly this long, so that two endpoints' outputs can be compared token for token.
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_ready: Path) -> Tokenizer:
    return Tokenizer(tiny_model_ready)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def tokens(server: ServerProcess, messages: list[Any], **fields: Any) -> list[int]:
    resp = post(server, "/tokenize", {"model": MODEL, "messages": messages, **fields})
    assert resp.status_code == 200, resp.text
    ids: list[int] = resp.json()["tokens"]
    return ids


def chat(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    resp = post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **body})
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    validate(out, "CreateChatCompletionResponse")
    return out


def stream(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    return chat_chunks(server, {"model": MODEL, "messages": MESSAGES, **body})


def test_the_prompt_ends_inside_the_assistants_message(server: ServerProcess,
                                                       tokenizer: Tokenizer) -> None:
    """continue_final_message: the prompt is the conversation up to the prefill's last
    character (no end of turn, no new assistant turn); the default closes the assistant's
    message and opens a new one."""
    kept_open = tokens(server, MESSAGES, **CONTINUE)
    closed = tokens(server, MESSAGES, add_generation_prompt=False)
    restarted = tokens(server, MESSAGES)
    assert tokenizer.decode(kept_open, skip_special_tokens=False).endswith(
        "<|assistant|>\n" + PREFILL)
    # The same tokens, less the message's end: its EOS and the newline after it.
    assert closed[:len(kept_open)] == kept_open
    assert tokenizer.decode(closed[len(kept_open):], skip_special_tokens=False) == "</s>\n"
    assert tokenizer.decode(restarted[len(closed):], skip_special_tokens=False) == "<|assistant|>\n"
    assert restarted[:len(closed)] == closed
    # continue_final_message alone implies add_generation_prompt false (as vLLM accepts it).
    assert tokens(server, MESSAGES, continue_final_message=True) == kept_open


def test_the_model_continues_the_prefill(server: ServerProcess, tokenizer: Tokenizer,
                                         greedy_reference: GreedyReference) -> None:
    """The chat endpoint generates, after the open message, what the completions endpoint
    generates from the same token ids: a continuation of the prefill, not a new message."""
    prompt = tokens(server, MESSAGES, **CONTINUE)
    continued = chat(server, {**CONTINUE, **GREEDY})
    assert continued["prompt_token_ids"] == prompt
    assert continued["usage"]["prompt_tokens"] == len(prompt)
    completion = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, **GREEDY})
    assert completion.status_code == 200, completion.text
    want = completion.json()["choices"][0]
    got = continued["choices"][0]
    assert len(got["token_ids"]) == GREEDY["max_tokens"]
    assert_same_greedy_tokens([got["token_ids"]], [want["token_ids"]], [prompt], greedy_reference)
    if IS_EXACT_DTYPE:
        assert got["message"]["content"] == want["text"]
    # Without it, the model answers in a new message: another prompt.
    restarted = chat(server, GREEDY)
    assert restarted["prompt_token_ids"] == tokens(server, MESSAGES)
    assert restarted["prompt_token_ids"] != prompt


def test_echo_puts_the_prefill_before_the_continuation(client: openai.OpenAI,
                                                       tokenizer: Tokenizer) -> None:
    """The openai client reads one message: the prefill and what the model added to it."""
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=8, temperature=0,
        extra_body={**CONTINUE, "echo": True, "ignore_eos": True, "return_token_ids": True})
    choice = resp.choices[0]
    added = tokenizer.decode((choice.model_extra or {})["token_ids"])
    assert added and choice.message.content == PREFILL + added
    assert resp.usage is not None and resp.usage.completion_tokens == 8  # not the prefill's


def test_echo_streams_the_prefill_in_the_first_delta(server: ServerProcess,
                                                     tokenizer: Tokenizer) -> None:
    chunks = stream(server, {**CONTINUE, **GREEDY, "echo": True, "n": 2, "temperature": 1,
                             "seed": 3})
    for index in (0, 1):
        deltas = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert deltas[0]["delta"] == {"role": "assistant", "content": PREFILL}
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        ids = [t for d in deltas for t in d.get("token_ids") or []]
        assert len(ids) == GREEDY["max_tokens"]
        assert content == PREFILL + tokenizer.decode(ids)


def test_echo_is_the_assistants_last_message_only(server: ServerProcess,
                                                  tokenizer: Tokenizer) -> None:
    """vLLM's rule: the last message is echoed when it is the assistant's, continued or not
    (add_generation_prompt true starts a new message after it); a user's is not."""
    after = chat(server, {**GREEDY, "echo": True})["choices"][0]
    assert after["message"]["content"] == PREFILL + tokenizer.decode(after["token_ids"])
    user_last = chat(server, {**GREEDY, "echo": True, "messages": MESSAGES[:1]})["choices"][0]
    assert user_last["message"]["content"] == tokenizer.decode(user_last["token_ids"])


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": True},
     "add_generation_prompt"),
    ("/tokenize", {"continue_final_message": True, "add_generation_prompt": True},
     "add_generation_prompt"),
    ("/v1/chat/completions", {"continue_final_message": True, "messages": MESSAGES[:1]},
     "continue_final_message"),
    ("/tokenize", {"continue_final_message": True, "messages": MESSAGES[:1]},
     "continue_final_message"),
    ("/v1/chat/completions", {"continue_final_message": True, "messages": [
        *MESSAGES[:1], {"role": "assistant", "content": " \n"}]}, "continue_final_message"),
    ("/v1/chat/completions", {"continue_final_message": "yes"}, "continue_final_message"),
    ("/v1/chat/completions", {"echo": 1}, "echo"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"continue_final_message": True}},
     "chat_template_kwargs"),
    ("/tokenize", {"continue_final_message": True, "messages": None, "prompt": "hi"},
     "continue_final_message"),
])
def test_a_prompt_ending_that_cannot_be_had_is_a_400(server: ServerProcess, path: str,
                                                     fields: dict[str, Any], param: str) -> None:
    budget = {"max_tokens": 4} if path.startswith("/v1") else {}  # short, were it served
    resp = post(server, path, {"model": MODEL, "messages": MESSAGES, **budget, **fields})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ":"), error


def test_the_fleet_router_sees_the_continued_prompt(server: ServerProcess,
                                                    tiny_model_ready: Path) -> None:
    """`--replicas N` routes by the prompt the replica runs: the open message's."""
    pytest.importorskip("ray")
    from fastserve.cluster.ingress import RouteHints

    body = {"model": MODEL, "messages": MESSAGES, **CONTINUE, "max_tokens": 1}
    hints = RouteHints(Tokenizer(tiny_model_ready), block_size=4)
    routed = asyncio.run(hints.route("/v1/chat/completions", json.dumps(body).encode()))
    assert routed is not None
    assert routed.num_prompt_tokens == len(tokens(server, MESSAGES, **CONTINUE))
