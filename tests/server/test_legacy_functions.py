"""OpenAI's deprecated function calling over HTTP against a real server, read by the `openai`
client: `functions` and `function_call` run as tools do, the call comes back as the message's
`function_call` (one call, no `tool_calls`; finish_reason `function_call`), streamed as
`function_call` pieces; a conversation's `function_call` and `function` messages reach the
chat template as a tool call and its result.

As in test_tool_calls_api.py, the random-weight model calls only where it is made to: a named
function_call (the grammar), or, for auto, text whose shape a `guided_regex` fixes.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.helpers import ServerProcess, validate
from tests.server.test_tool_calls_api import MESSAGES, MODEL, WEATHER, post, stream

pytest.importorskip("xgrammar")

FUNCTIONS: list[Any] = [
    {"name": "get_weather", "description": "Today's weather in a city", "parameters": WEATHER},
    {"name": "add", "parameters": {"type": "object"}}]
TOOLS: list[Any] = [{"type": "function", "function": f} for f in FUNCTIONS]
# Text, then two calls in the Hermes format: the legacy shape holds the first.
TWO_CALLS = (r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "(Paris|Rome)", "unit": "c"\}\}\n</tool_call>\n<tool_call>\n'
             r'\{"name": "add", "arguments": \{"a": 1\}\}\n</tool_call>')


def test_a_named_function_call_comes_back_as_function_call(client: openai.OpenAI) -> None:
    for seed in range(3):
        resp = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, functions=FUNCTIONS, seed=seed,
            function_call={"name": "get_weather"}, max_completion_tokens=200)
        validate(resp.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
        choice = resp.choices[0]
        assert choice.finish_reason == "stop"  # OpenAI's: a forced call is no choice to call
        assert choice.message.tool_calls is None and choice.message.content is None
        call = choice.message.function_call
        assert call is not None and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)


@pytest.mark.parametrize("streamed", [False, True])
def test_auto_answers_the_first_call_as_function_call(server: ServerProcess,
                                                      streamed: bool) -> None:
    """The model chose to call: finish_reason function_call, the one call (of two written)."""
    body = {"functions": FUNCTIONS, "guided_regex": TWO_CALLS, "max_tokens": 300}
    if streamed:
        chunks = stream(server, body)
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        assert not any("tool_calls" in d["delta"] for d in deltas)
        pieces = [d["delta"]["function_call"] for d in deltas if "function_call" in d["delta"]]
        assert len(pieces) >= 1 and [p.get("name") for p in pieces[:1]] == ["get_weather"]
        assert all("name" not in p for p in pieces[1:])  # the name once, then the arguments
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        call = {"name": "get_weather", "arguments": "".join(p.get("arguments", "") for p in pieces)}
        finish = deltas[-1]["finish_reason"]
    else:
        resp = post(server, body)
        assert resp.status_code == 200, resp.text
        validate(resp.json(), "CreateChatCompletionResponse")
        choice = resp.json()["choices"][0]
        assert "tool_calls" not in choice["message"]
        content, call, finish = (choice["message"]["content"], choice["message"]["function_call"],
                                 choice["finish_reason"])
    assert finish == "function_call"
    assert content == "Sure."
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"])["city"] in ("Paris", "Rome")


def test_the_openai_client_reads_a_streamed_function_call(client: openai.OpenAI) -> None:
    """Streamed: the same call as the whole response, put together from its pieces."""
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "functions": FUNCTIONS,
                            "function_call": {"name": "get_weather"}, "seed": 1,
                            "max_completion_tokens": 200}
    whole = client.chat.completions.create(**body).choices[0]
    name, arguments, finish = None, "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            assert c.delta.tool_calls is None
            if c.delta.function_call is not None:
                name = name or c.delta.function_call.name
                arguments += c.delta.function_call.arguments or ""
            finish = c.finish_reason or finish
    assert whole.message.function_call is not None
    assert (name, arguments) == (whole.message.function_call.name,
                                 whole.message.function_call.arguments)
    assert finish == whole.finish_reason == "stop"


def test_function_call_none_leaves_the_text_alone(server: ServerProcess) -> None:
    resp = post(server, {"functions": FUNCTIONS, "function_call": "none",
                         "guided_regex": TWO_CALLS, "max_tokens": 300})
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "function_call" not in choice["message"]
    assert choice["message"]["content"].startswith('Sure. <tool_call>\n{"name": "get_weather"')


def test_a_legacy_conversation_renders_as_its_tool_calls(server: ServerProcess) -> None:
    """An assistant's function_call and the function message answering it are the tool call
    and the tool result the chat template writes: the same prompt, token for token."""
    legacy = [*MESSAGES,
              {"role": "assistant", "content": None,
               "function_call": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
              {"role": "function", "name": "get_weather", "content": '{"celsius": 21}'}]
    as_tools = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call00001", "type": "function", "function": legacy[1]["function_call"]}]},
                {"role": "tool", "tool_call_id": "call00001", "name": "get_weather",
                 "content": '{"celsius": 21}'}]
    prompts = []
    for body in ({"messages": legacy, "functions": FUNCTIONS},
                 {"messages": as_tools, "tools": TOOLS}):
        resp = post(server, {**body, "max_tokens": 1, "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        prompts.append(resp.json()["prompt_token_ids"])
    assert prompts[0] == prompts[1]
    text = httpx.post(server.url + "/detokenize", json={"tokens": prompts[0]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text
    assert '<|tool|>\n{"celsius": 21}' in text


@pytest.mark.parametrize(("fields", "param"), [
    ({"functions": FUNCTIONS, "tools": TOOLS}, "functions"),
    ({"functions": FUNCTIONS, "tool_choice": "auto"}, "functions"),
    ({"tools": TOOLS, "function_call": "auto"}, "function_call"),
    ({"function_call": {"name": "get_weather"}}, "function_call"),
    ({"functions": FUNCTIONS, "function_call": {"name": "nope"}}, "function_call"),
    ({"functions": [FUNCTIONS[0], FUNCTIONS[0]]}, "functions[1].name"),
    ({"functions": FUNCTIONS, "parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"functions": [{"name": "f", "parameters": {"type": "objekt"}}],
      "function_call": {"name": "f"}}, "functions[0].parameters"),
    ({"function_call": "sometimes"}, "function_call"),
    ({"messages": [*MESSAGES, {"role": "function", "content": "21"}]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[0]"),
    ({"messages": [*MESSAGES, {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"},
                               "tool_calls": [{"id": "c", "type": "function", "function": {
                                   "name": "f", "arguments": "{}"}}]}]}, "messages[1]"),
])
def test_bad_function_fields_are_400_naming_them(server: ServerProcess, fields: dict[str, Any],
                                                 param: str) -> None:
    resp = post(server, {"max_tokens": 4, **fields})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
