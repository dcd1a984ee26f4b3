"""Structured output over HTTP: OpenAI's `response_format` (json_object, json_schema), vLLM's
structural tags (`response_format` type structural_tag, `structured_outputs.structural_tag`)
and `guided_json` / `guided_regex` / `guided_choice`, against a real server driven by the
`openai` client, its `parse` helper with a pydantic model included."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.server.helpers import ServerProcess

pytest.importorskip("xgrammar")

MODEL = "tiny"
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a user as JSON."}]


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.v1 + path, json={"model": MODEL, **body}, timeout=120)


USER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "role": {"enum": ["admin", "guest"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "role", "age", "tags"],
}


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    for seed in range(4):
        resp = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=150, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "user", "schema": USER_SCHEMA, "strict": True}})
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), USER_SCHEMA)


def test_response_format_json_object_streams(server: ServerProcess) -> None:
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, "stream": True,
            "response_format": {"type": "json_object"}}
    text = ""
    with httpx.stream("POST", server.v1 + "/chat/completions", json={"model": MODEL, **body},
                      timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    assert text.startswith("{")  # a random model may still be inside the object at max_tokens


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    kind: Literal["cat", "dog", "fish"]
    legs: int = pydantic.Field(ge=0, le=8)


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    parses = [client.chat.completions.parse]
    if hasattr(client, "beta") and hasattr(client.beta, "chat"):
        parses.append(client.beta.chat.completions.parse)
    for seed, parse in enumerate(parses):
        resp = parse(model=MODEL, messages=MESSAGES, response_format=Pet, seed=seed,
                     max_completion_tokens=100)
        pet = resp.choices[0].message.parsed
        assert isinstance(pet, Pet) and 0 <= pet.legs <= 8 and len(pet.name) <= 6


def test_guided_fields(client: openai.OpenAI) -> None:
    regex = r"\d{3}-[A-Z]{2}"
    resp = client.completions.create(model=MODEL, prompt="code:", max_tokens=20, seed=1,
                                     extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, resp.choices[0].text) and resp.choices[0].finish_reason == "stop"
    choices = ["positive", "negative", "neutral"]
    resp2 = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                           extra_body={"guided_choice": choices})
    assert resp2.choices[0].message.content in choices
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for guided in (schema, json.dumps(schema)):  # an object or its text
        resp3 = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                               extra_body={"guided_json": guided})
        assert isinstance(json.loads(resp3.choices[0].message.content or "")["ok"], bool)


OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _tagged(text: str, begin: str, end: str) -> tuple[dict[str, Any], str]:
    """The JSON between `begin` and `end` at the start of `text`, and the text after."""
    assert text.startswith(begin), text
    body, found, rest = text[len(begin):].partition(end)
    assert found, text
    return json.loads(body), rest


def test_structural_tags_in_both_forms(server: ServerProcess, client: openai.OpenAI) -> None:
    """xgrammar's form: a tag the whole output must be. vLLM's first form: text is free until
    a trigger, then a structure. Built on greedy decoding: the free output's first token is
    the trigger, so the structure comes right there."""
    fmt = {"type": "tag", "begin": "<answer>", "end": "</answer>",
           "content": {"type": "json_schema", "json_schema": OK_SCHEMA, "max_whitespace_cnt": 1}}
    for body in ({"response_format": {"type": "structural_tag", "format": fmt}},
                 {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": fmt}}},
                 {"structured_outputs": {"structural_tag": json.dumps(
                     {"type": "structural_tag", "format": fmt})}}):
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30,
                                              extra_body=body)
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        answer, rest = _tagged(choice.message.content or "", "<answer>", "</answer>")
        assert isinstance(answer["ok"], bool) and rest == ""
    free = client.completions.create(model=MODEL, prompt="code:", max_tokens=1, temperature=0)
    trigger = free.choices[0].text
    assert trigger.strip()
    structure = {"begin": trigger + "=", "schema": OK_SCHEMA, "end": ";"}
    for field, value in (("response_format", {"type": "structural_tag", "structures": [structure],
                                              "triggers": [trigger]}),
                         ("structured_outputs", {"structural_tag": json.dumps(
                             {"structures": [structure], "triggers": [trigger]})})):
        tagged = client.completions.create(model=MODEL, prompt="code:", max_tokens=30,
                                           temperature=0, extra_body={field: value})
        answer, _ = _tagged(tagged.choices[0].text, trigger + "=", ";")
        assert isinstance(answer["ok"], bool)


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "structural_tag", "format": {"type": "bogus"}}},
     "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": [
        {"begin": "<a>", "schema": OK_SCHEMA, "end": "</a>"}], "triggers": ["<b"]}},
     "response_format"),  # no structure begins with the trigger
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<a"]}}, "response_format"),
    ({"response_format": {"type": "json_object", "format": {"type": "any_text"}}},
     "response_format"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": {"structures": [{"begin": "<a>"}], "triggers": ["<a"]}}},
     "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces"}}},
     "response_format.json_schema.name"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
])
def test_invalid_grammar_is_400_naming_the_field(server: ServerProcess, fields: dict[str, Any],
                                                 param: str) -> None:
    resp = post(server, "/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **fields})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    # ... and the server goes on serving.
    ok = post(server, "/completions", {"prompt": "a", "max_tokens": 3, "guided_choice": ["z"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "z"


def test_openapi_types_the_fields(server: ServerProcess) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        assert {"response_format", "guided_json", "guided_regex", "guided_choice"} <= set(props)
    assert "schema" in schemas["JsonSchemaFormat"]["properties"]
