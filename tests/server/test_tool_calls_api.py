"""Tool calling over HTTP against a real server driven by the `openai` client: `tools`,
`tool_choice` (auto, required, a named function, none), `parallel_tool_calls`, streamed
calls, a conversation that carries calls and their results back, and the SDK's `parse` with
a pydantic tool.

The random-weight model never chooses to call a tool by itself, so the calls it makes here
are the ones the grammar forces (`required`, a named function), or, for `auto`, text whose
shape a `guided_regex` fixes: the parser then reads the calls out of it as it would a real
model's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
import transformers

from fastserve.model.tokenizer import Tokenizer
from tests.server.helpers import ServerProcess, chat_chunks, validate

pytest.importorskip("xgrammar")

MODEL = "tiny"
MESSAGES: list[Any] = [{"role": "user", "content": "What's the weather in Paris?"}]
# Bounded, so that a random model's arguments end (an unbounded integer never would).
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS: list[Any] = [{"type": "function", "function": {"name": name, "parameters": schema}}
                    for name, schema in SCHEMAS.items()]
# What `auto` is given to read in the tests: text, then one call in the Hermes format.
FORCED_CALL = (r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Rome)", "unit": "c"\}\}\n</tool_call>')


def post(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.v1 + "/chat/completions",
                      json={"model": MODEL, "messages": MESSAGES, **body}, timeout=120)


def stream(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    return chat_chunks(server, {"model": MODEL, "messages": MESSAGES, **body})


def assembled(chunks: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
    """Choice `index`'s message and finish_reason, put together from its deltas as a client
    does: a call's first delta has its id and name, its arguments come in parts."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk["choices"]:
            if c["index"] != index:
                continue
            content += c["delta"].get("content") or ""
            for d in c["delta"].get("tool_calls") or []:
                first = d["index"] not in calls  # only a call's first delta has id and name
                assert ("id" in d and "name" in d["function"]) == first, d
                call = calls.setdefault(d["index"], {"id": d.get("id"), "type": d.get("type"),
                                                     "function": {"name": d["function"].get("name"),
                                                                  "arguments": ""}})
                call["function"]["arguments"] += d["function"].get("arguments") or ""
            finish = c["finish_reason"] or finish
    message: dict[str, Any] = {"content": content or None if calls else content}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return {"message": message, "finish_reason": finish}


def check_calls(calls: list[Any], finish_reason: str | None = None) -> None:
    """Each call names a declared function, and its arguments match that function's schema
    (but for the last one's when max_tokens cut the output short: those are what was written)."""
    assert calls
    whole = calls[:-1] if finish_reason == "length" else calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] in SCHEMAS
    for call in whole:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_named_tool_choice_calls_exactly_that_function(client: openai.OpenAI) -> None:
    for seed in range(4):
        resp = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, seed=seed, max_completion_tokens=200,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = resp.choices[0]
        assert choice.finish_reason == "stop"  # OpenAI's: a forced call is no choice to call
        assert choice.message.content is None
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        check_calls(calls)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_choice_makes_valid_calls(server: ServerProcess, parallel: bool) -> None:
    for seed in range(3):
        resp = post(server, {"tools": TOOLS, "tool_choice": "required", "seed": seed,
                             "parallel_tool_calls": parallel, "max_tokens": 200})
        assert resp.status_code == 200, resp.text
        validate(resp.json(), "CreateChatCompletionResponse")
        choice = resp.json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        check_calls(calls, choice["finish_reason"])
        if not parallel:  # one call, then the grammar ends the output
            assert len(calls) == 1
            assert choice["message"]["content"] is None
            assert choice["finish_reason"] == "tool_calls"
        assert len({c["id"] for c in calls}) == len(calls)


def test_streamed_calls_are_the_response_calls(server: ServerProcess) -> None:
    for seed in range(2):
        body = {"tools": TOOLS, "tool_choice": "required", "seed": seed, "max_tokens": 120}
        whole = post(server, body).json()["choices"][0]
        streamed = assembled(stream(server, body))
        assert streamed["finish_reason"] == whole["finish_reason"]
        assert streamed["message"]["content"] == whole["message"]["content"]

        def calls(message: dict[str, Any]) -> list[tuple[str, str]]:
            return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]

        assert calls(streamed["message"]) == calls(whole["message"])
        check_calls(streamed["message"]["tool_calls"], streamed["finish_reason"])


@pytest.mark.parametrize("streamed", [False, True])
def test_auto_reads_calls_out_of_the_text(server: ServerProcess, streamed: bool) -> None:
    body = {"tools": TOOLS, "guided_regex": FORCED_CALL, "max_tokens": 100}
    choice = assembled(stream(server, body)) if streamed else post(server, body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")


def test_tool_choice_none_leaves_the_text_alone(server: ServerProcess) -> None:
    resp = post(server, {"tools": TOOLS, "tool_choice": "none", "guided_regex": FORCED_CALL,
                         "max_tokens": 100})
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("Sure. <tool_call>\n{\"name\": \"get_weather\"")


def test_auto_without_a_call_is_plain_content(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, seed=0,
                                          max_completion_tokens=20)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=0,
                                           max_completion_tokens=20)
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert choice.message.content  # the tools' preamble changed the prompt, not the shape
    assert resp.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt


def test_each_choice_makes_its_own_calls(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=3, seed=5,
        parallel_tool_calls=False, max_completion_tokens=120)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    ids = []
    for choice in resp.choices:
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        assert len(calls) == 1 and choice.finish_reason == "tool_calls"
        check_calls(calls)
        ids.append(calls[0]["id"])
    assert len(set(ids)) == 3


def test_a_conversation_carries_calls_and_results_back(
        client: openai.OpenAI, tiny_model_ready: Path) -> None:
    """The prompt is the chat template's rendering of the tools, the assistant's calls (their
    arguments as objects) and the tool's answer, as transformers renders them."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
    messages: list[Any] = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, seed=0,
                                          max_completion_tokens=4)
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_ready)
    as_templates_read = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        messages[2]]
    text = hf.apply_chat_template(as_templates_read, tools=TOOLS, tokenize=False,
                                  add_generation_prompt=True)
    assert '"arguments": {"city": "Paris", "unit": "c"}' in text and '{"celsius": 21}' in text
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(Tokenizer(tiny_model_ready).encode(text))


def test_the_fleet_router_sees_the_replicas_prompt(client: openai.OpenAI,
                                                   tiny_model_ready: Path) -> None:
    """`fastserve serve --replicas N` routes by the prompt the replica will run: tools and
    tool calls included."""
    pytest.importorskip("ray")
    from fastserve.cluster.ingress import RouteHints

    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    body = {"model": MODEL, "tools": TOOLS, "max_tokens": 2, "messages": [
        *MESSAGES, {"role": "assistant", "content": "Adding.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]}
    hints = RouteHints(Tokenizer(tiny_model_ready), block_size=16)
    routed = asyncio.run(hints.route("/v1/chat/completions", json.dumps(body).encode()))
    resp = client.chat.completions.create(**body)
    assert routed is not None and resp.usage is not None
    assert routed.num_prompt_tokens == resp.usage.prompt_tokens


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    unit: str = pydantic.Field(pattern="^(c|f)$")


def test_sdk_parse_with_a_pydantic_tool(client: openai.OpenAI) -> None:
    """The SDK's strict pydantic tools, parsed back into the model by `parse`."""
    resp = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", parallel_tool_calls=False, seed=1, max_completion_tokens=120)
    (call,) = resp.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert len(call.function.parsed_arguments.city) <= 10


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": TOOLS, "parallel_tool_calls": False, "guided_json": {"type": "object"}},
     "guided_json"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "21"}]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0]"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_bad_tool_fields_are_400_naming_them(server: ServerProcess, fields: dict[str, Any],
                                             param: str) -> None:
    resp = post(server, {"max_tokens": 4, **fields})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
