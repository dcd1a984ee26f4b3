"""OpenAI's Responses API (`POST /v1/responses`) against a real server: the `openai` client's
`responses.create`, `responses.stream` and `responses.parse`, raw bodies and events checked
against the SDK's own types, and the same answers as the chat completion each request
amounts to."""

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
from openai.types.responses import Response, ResponseStreamEvent

from fastserve.model.tokenizer import Tokenizer
from tests.server.helpers import ServerProcess

MODEL = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def create(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    """A whole response's raw body, checked against the SDK's `Response`."""
    resp = httpx.post(server.v1 + "/responses", json={"model": MODEL, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    Response.model_validate(resp.json())
    return resp.json()


def events(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's events: each an `event:` line naming its type, then the SDK-typed data,
    numbered in order from 0."""
    out: list[dict[str, Any]] = []
    with httpx.stream("POST", server.v1 + "/responses", timeout=120,
                      json={"model": MODEL, "stream": True, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        kind = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == kind and data["sequence_number"] == len(out)
                EVENTS.validate_python(data)
                out.append(data)
    return out


def text_of(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def test_a_response_is_the_chat_completion_it_amounts_to(server: ServerProcess,
                                                         client: openai.OpenAI) -> None:
    resp = create(server, {"input": "Tell me about rivers.", "instructions": "Be brief.",
                           "max_output_tokens": 12, "seed": 3})
    chat = client.chat.completions.create(
        model=MODEL, max_completion_tokens=12, seed=3,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Tell me about rivers."}])
    assert text_of(resp) == chat.choices[0].message.content
    assert chat.usage is not None
    assert resp["usage"]["input_tokens"] == chat.usage.prompt_tokens
    assert resp["usage"]["output_tokens"] == 12
    # Cut at max_output_tokens: incomplete, as OpenAI reports it.
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["output"][0]["status"] == "incomplete"


def test_vllms_sampling_fields_pass_to_the_chat_completion(server: ServerProcess) -> None:
    """vLLM's Responses extensions (top_k, ignore_eos, penalties, stop, ...) act as they do
    on the chat completion the response runs as."""
    fields = {"top_k": 1, "temperature": 1.0, "ignore_eos": True, "repetition_penalty": 1.3,
              "logit_bias": {"7": -100}, "min_p": 0.01}
    resp = create(server, {"input": "Tell me about rivers.", "max_output_tokens": 12, **fields})
    chat = httpx.post(server.v1 + "/chat/completions", timeout=120, json={
        "model": MODEL, "max_completion_tokens": 12, **fields,
        "messages": [{"role": "user", "content": "Tell me about rivers."}]}).json()
    text = text_of(resp)
    assert text == chat["choices"][0]["message"]["content"] and resp["usage"]["output_tokens"] == 12
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    stopped = create(server, {"input": "Tell me about rivers.", "max_output_tokens": 12, **fields,
                              "stop": [stop]})
    assert text_of(stopped) == text[:text.index(stop)] and stopped["status"] == "completed"
    bad = httpx.post(server.v1 + "/responses", timeout=60,
                     json={"model": MODEL, "input": "hi", "top_k": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k", bad.text


def test_the_stream_builds_the_same_response(server: ServerProcess) -> None:
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            "max_output_tokens": 10, "seed": 1}
    whole = create(server, body)
    stream = events(server, body)
    kinds = [e["type"] for e in stream]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = "".join(e["delta"] for e in stream if e["type"] == "response.output_text.delta")
    assert deltas == text_of(whole) == text_of(stream[-1]["response"])
    usage = stream[-1]["response"]["usage"]  # the second run found the prompt cached
    assert (usage["input_tokens"], usage["output_tokens"]) == (whole["usage"]["input_tokens"], 10)
    assert usage["input_tokens_details"]["cached_tokens"] > 0


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    river: bool


def test_sdk_stream_and_parse(client: openai.OpenAI) -> None:
    """The SDK's helpers: `responses.stream` collects a completed response, `responses.parse`
    reads the output into a pydantic model (text.format json_schema)."""
    with client.responses.stream(model=MODEL, input="A city as JSON.", text_format=City,
                                 max_output_tokens=60, extra_body={"seed": 2}) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas
    assert isinstance(final.output_parsed, City)
    parsed = client.responses.parse(model=MODEL, input="A city as JSON.", text_format=City,
                                    max_output_tokens=60, extra_body={"seed": 2})
    assert parsed.output_parsed == final.output_parsed


def test_function_calls_and_their_outputs(server: ServerProcess, client: openai.OpenAI) -> None:
    # max_tool_calls bounds built-in tools' calls (there are none): a function call comes back.
    body = {"input": "Weather in Paris?", "tools": [TOOL], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 200, "seed": 0, "max_tool_calls": 0}
    resp = create(server, body)
    assert resp["max_tool_calls"] == 0
    (call,) = resp["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert resp["status"] == "completed" and call["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    stream = events(server, body)
    streamed = stream[-1]["response"]["output"][0]
    assert (streamed["name"], streamed["arguments"]) == (call["name"], call["arguments"])
    pieces = "".join(e["delta"] for e in stream
                     if e["type"] == "response.function_call_arguments.delta")
    assert pieces == call["arguments"]
    # The call and its output sent back, as the SDK returns the item: the prompt is the chat
    # completion's with the assistant's call and the tool's answer.
    followup = client.responses.create(model=MODEL, tools=[TOOL], max_output_tokens=2, input=[
        {"role": "user", "content": "Weather in Paris?"}, call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": '{"celsius": 21}'}])
    chat = client.chat.completions.create(
        model=MODEL, max_completion_tokens=2, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call["call_id"], "type": "function",
                 "function": {"name": call["name"], "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["call_id"], "content": '{"celsius": 21}'}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                 "strict": True}}])
    assert followup.usage is not None and chat.usage is not None
    assert followup.usage.input_tokens == chat.usage.prompt_tokens


def test_the_fleet_router_sees_the_replicas_prompt(client: openai.OpenAI,
                                                   tiny_model_ready: Path) -> None:
    """`fastserve serve --replicas N` routes a response by the prompt the replica will run."""
    pytest.importorskip("ray")
    from fastserve.cluster.ingress import RouteHints

    body = {"model": MODEL, "instructions": "Be brief.", "tools": [TOOL], "max_output_tokens": 2,
            "input": [{"role": "user", "content": "Weather?"},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather",
                       "arguments": '{"city": "Rome", "unit": "c"}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "21"}]}
    hints = RouteHints(Tokenizer(tiny_model_ready), block_size=16)
    routed = asyncio.run(hints.route("/v1/responses", json.dumps(body).encode()))
    resp = client.responses.create(**body)
    assert routed is not None and resp.usage is not None
    assert routed.num_prompt_tokens == resp.usage.input_tokens


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": "x", "call_id": "c"}]}, "input[0]"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools[1].name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}},
     "text.format.schema"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # the template has no effort
    ({"max_tool_calls": -1}, "max_tool_calls"),
])
def test_bad_fields_are_400_naming_them(server: ServerProcess, fields: dict[str, Any],
                                        param: str) -> None:
    resp = httpx.post(server.v1 + "/responses", timeout=60,
                      json={"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_truncation_auto_keeps_the_latest_turns_that_fit(server: ServerProcess) -> None:
    """A conversation beyond the context: a 400 by default; with `truncation: auto` its oldest
    turns go (whole, from a user message on; the system message stays) and the answer uses
    the most that fit."""
    max_model_len = httpx.get(server.v1 + "/models").json()["data"][0]["max_model_len"]
    system = {"role": "system", "content": "Answer briefly."}
    turns: list[dict[str, Any]] = []
    for t in range(12):
        turns += [{"role": "user", "content": " ".join(f"item{t}x{i}" for i in range(120))},
                  {"role": "assistant", "content": f"Noted {t}."}]
    turns.append({"role": "user", "content": "What now?"})
    body = {"input": [system, *turns], "max_output_tokens": 16}

    def count(items: list[dict[str, Any]]) -> int:
        return int(httpx.post(server.url + "/tokenize", timeout=60,
                              json={"messages": items}).json()["count"])

    assert count([system, *turns]) + 16 > max_model_len  # the state the test is about
    refused = httpx.post(server.v1 + "/responses", timeout=60, json={"model": MODEL, **body})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    resp = create(server, {**body, "truncation": "auto"})
    assert resp["truncation"] == "auto"
    starts = [i for i, item in enumerate(turns) if item["role"] == "user"]
    fitting = next(i for i in starts if count([system, *turns[i:]]) + 16 <= max_model_len)
    assert fitting > 0 and resp["usage"]["input_tokens"] == count([system, *turns[fitting:]])
