"""The Responses API's stored responses: `previous_response_id` continues a conversation as
if it had been sent whole (the same prompt, the same greedy answer), `GET` returns a stored
response and `DELETE` forgets it; `store: false` keeps nothing; the store's byte budget drops
the least recently used."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fastserve.args import engine_config
from fastserve.engine.async_llm import AsyncLLM
from fastserve.server.app import build_app
from fastserve.server.response_store import ResponseStore
from fastserve.server.responses_schemas import InputItem, OutputMessage, OutputText, ResponseObject
from tests.conftest import TEST_DTYPE
from tests.server.helpers import ServerProcess
from tests.server.test_responses_api import TOOL, events

MODEL = "tiny"
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 8}


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(input="Tell me a joke.", instructions="Be brief.", **GREEDY)
    assert first.store is True
    second = client.responses.create(previous_response_id=first.id, **GREEDY,
                                     input=[{"role": "user", "content": "Why is it funny?"}])
    assert second.previous_response_id == first.id
    # The same conversation, sent whole (earlier instructions are not carried over, as OpenAI's).
    whole = client.responses.create(store=False, **GREEDY, input=[
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Why is it funny?"}])
    assert second.usage is not None and whole.usage is not None
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.output_text == whole.output_text
    # A third turn walks the chain of two.
    third = client.responses.create(previous_response_id=second.id, input="And then?", **GREEDY)
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens


def test_a_stored_response_is_retrieved_and_deleted(client: openai.OpenAI, server: ServerProcess) -> None:
    kept = client.responses.create(input="Hello!", **GREEDY)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    follow = client.responses.create(previous_response_id=kept.id, input="More.", **GREEDY)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    resp = httpx.post(server.v1 + "/responses", timeout=60, json={
        **GREEDY, "previous_response_id": follow.id, "input": "Go on."})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"
    assert kept.id in error["message"] and follow.id in error["message"]  # the chain's broken link
    assert httpx.delete(server.v1 + f"/responses/{kept.id}").status_code == 404


def test_input_items_list_what_the_response_was_given(client: openai.OpenAI, server: ServerProcess) -> None:
    first = client.responses.create(input="Tell me a joke.", **GREEDY)
    second = client.responses.create(previous_response_id=first.id, **GREEDY, input=[
        {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "Go."}])

    def texts(page: Any) -> list[str]:
        return [item.content[0].text for item in page.data]

    newest_first = client.responses.input_items.list(second.id)  # its own input, not first's
    assert texts(newest_first) == ["Go.", "Sure.", "Another?"] and not newest_first.has_more
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert texts(page) == ["Another?", "Sure."] and page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=page.data[-1].id)
    assert texts(rest) == ["Go."] and not rest.has_more
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    bad = httpx.get(server.v1 + f"/responses/{second.id}/input_items", params={"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    gone = client.responses.create(input="Hello!", store=False, **GREEDY)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)


def test_a_streamed_response_is_stored_before_it_completes(server: ServerProcess,
                                                           client: openai.OpenAI) -> None:
    streamed = events(server, {**GREEDY, "input": "Hi there."})
    done = streamed[-1]["response"]
    assert streamed[-1]["type"] == f"response.{done['status']}" and done["store"] is True
    assert client.responses.retrieve(done["id"]).model_dump(exclude_none=True) \
        == openai.types.responses.Response.model_validate(done).model_dump(exclude_none=True)


def test_a_function_call_is_continued_with_its_output(client: openai.OpenAI) -> None:
    pytest.importorskip("xgrammar")
    asked = client.responses.create(input="Weather in Rome?", tools=[TOOL], tool_choice="required",
                                    parallel_tool_calls=False, model=MODEL, max_output_tokens=60)
    (call,) = [item for item in asked.output if item.type == "function_call"]
    answered = client.responses.create(
        previous_response_id=asked.id, tools=[TOOL], **GREEDY,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    whole = client.responses.create(store=False, tools=[TOOL], **GREEDY, input=[
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    assert answered.usage is not None and whole.usage is not None
    assert answered.usage.input_tokens == whole.usage.input_tokens


def test_a_server_that_keeps_none_says_so(tiny_model_ready: Path) -> None:
    """`--responses-store-mib 0` (and every replica of a fleet): responses say `store: false`;
    asking to store one, or to continue one, is a 400 naming the field."""
    llm = AsyncLLM(engine_config(dtype=TEST_DTYPE, warmup=False))
    app = build_app(llm, MODEL, responses_store_mib=0)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fastserve") as http:
            return [await http.post("/v1/responses", json={**GREEDY, "input": "Hi", **extra})
                    for extra in ({}, {"store": True}, {"previous_response_id": "resp_1"},
                                  {"background": True})]

    plain, stored, continued, background = asyncio.run(run())
    asyncio.run(llm.shutdown(grace_s=0))
    assert plain.status_code == 200 and plain.json()["store"] is False
    for resp, field in ((stored, "store"), (continued, "previous_response_id"),
                        (background, "background")):
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field
        assert "keeps no responses" in resp.json()["error"]["message"]


# -- the store itself ---------------------------------------------------------------------------

def _response(rid: str, text: str) -> ResponseObject:
    return ResponseObject(id=rid, created_at=0, status="completed", model=MODEL,
                          output=[OutputMessage(id="m", status="completed", content=[OutputText(text=text)])],
                          parallel_tool_calls=True, tool_choice="auto", tools=[], text={}, store=True)


def test_a_background_responses_events_are_kept_within_the_budget() -> None:
    """Its events are kept for GET ?stream=true; a response that fits only without them is
    kept without them."""
    one = _response("r1", "x" * 100)
    store = ResponseStore(max_bytes=1 << 20)
    store.put(one, [InputItem(role="user", content="hi", id="msg_1")], None)
    size = store.num_bytes  # the response and its input
    store = ResponseStore(max_bytes=size + 100)
    store.put(one, [InputItem(role="user", content="hi", id="msg_1")], None, ["a" * 50, "b" * 50])
    assert store.get("r1").events == ["a" * 50, "b" * 50]  # type: ignore[union-attr]
    assert store.num_bytes == size + 100
    store.put(one, [InputItem(role="user", content="hi", id="msg_1")], None, ["a" * 101])
    kept = store.get("r1")
    assert kept is not None and kept.events is None and store.num_bytes == size


def test_the_least_recently_used_go_first_within_the_budget() -> None:
    one = _response("r1", "x" * 1000)
    size = len(one.model_dump_json()) + len(InputItem(role="user", content="hi").model_dump_json())
    store = ResponseStore(max_bytes=2 * size + size // 2)  # room for two
    for rid in ("r1", "r2"):
        store.put(_response(rid, "x" * 1000), [InputItem(role="user", content="hi")], None)
    assert store.get("r1") is not None  # r1 is now the more recent
    store.put(_response("r3", "x" * 1000), [InputItem(role="user", content="hi")], "r1")
    assert store.get("r2") is None and len(store) == 2 and store.num_bytes <= store.max_bytes
    history = store.history("r3")
    assert [(i.role, i.content) for i in history] == [
        ("user", "hi"), ("assistant", "x" * 1000), ("user", "hi"), ("assistant", "x" * 1000)]
    store.put(_response("huge", "y" * 10 * size), [], None)  # larger than the whole budget
    assert store.get("huge") is None and len(store) == 2
    assert store.delete("r1") and not store.delete("r1")
    with pytest.raises(LookupError, match="'r1'.*'r3'"):
        store.history("r3")
