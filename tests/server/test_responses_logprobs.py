"""The Responses API's log-probabilities: `include: ["message.output_text.logprobs"]` with
`top_logprobs` puts each output token's log-probability, and its most likely alternatives, in
the answer's `output_text.logprobs` (streamed: in each `output_text.delta`), the same as the
chat completion the request amounts to returns."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import IS_EXACT_DTYPE
from tests.greedy import NEAR_TIE
from tests.server.helpers import ServerProcess
from tests.server.test_responses_api import MODEL, TOOL, create, events, text_of

# float32: the same arithmetic, so the same log-probabilities. A half type rounds a prefix-cache
# hit's chunk differently from a fresh prefill: within the near-tie bound (tests/greedy.py).
ATOL = 1e-4 if IS_EXACT_DTYPE else NEAR_TIE
BODY: dict[str, Any] = {"input": "Tell me about rivers.", "max_output_tokens": 8,
                        "temperature": 0, "include": ["message.output_text.logprobs"],
                        "top_logprobs": 2}


def test_logprobs_are_the_chat_completions(server: ServerProcess, client: openai.OpenAI) -> None:
    resp = create(server, BODY)
    part = resp["output"][0]["content"][0]
    assert resp["top_logprobs"] == 2
    chat = client.chat.completions.create(
        model=MODEL, max_completion_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "Tell me about rivers."}])
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    want = [lp.model_dump() for lp in chat.choices[0].logprobs.content]
    assert len(part["logprobs"]) == resp["usage"]["output_tokens"] == len(want) == 8
    assert all(len(got["top_logprobs"]) == 2 for got in part["logprobs"])
    if IS_EXACT_DTYPE:
        assert [lp["token"] for lp in part["logprobs"]] == [lp["token"] for lp in want]
        assert text_of(resp) == chat.choices[0].message.content
    for got, exp in zip(part["logprobs"], want, strict=True):
        if got["token"] != exp["token"]:  # a half type's near-tie: the two outputs part here
            break
        assert got["logprob"] == pytest.approx(exp["logprob"], abs=ATOL)
        if IS_EXACT_DTYPE:
            assert [t["token"] for t in got["top_logprobs"]] == [t["token"] for t in exp["top_logprobs"]]
    # Through the SDK: its own types read them.
    sdk = client.responses.create(model=MODEL, **BODY)
    first = sdk.output[0]
    assert first.type == "message" and first.content[0].type == "output_text"
    assert first.content[0].logprobs is not None and len(first.content[0].logprobs) == 8


def test_the_stream_carries_each_tokens_logprobs(server: ServerProcess) -> None:
    whole = create(server, BODY)["output"][0]["content"][0]["logprobs"]
    stream = events(server, BODY)
    deltas = [lp for e in stream if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert len(deltas) == len(whole) == 8
    if IS_EXACT_DTYPE:  # (a half type may part at a near-tie between the two requests)
        assert [lp["token"] for lp in deltas] == [lp["token"] for lp in whole]
    (done,) = [e for e in stream if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == deltas
    final = stream[-1]["response"]["output"][0]["content"][0]["logprobs"]
    assert final == deltas


def test_no_logprobs_unless_included(server: ServerProcess) -> None:
    resp = create(server, {**BODY, "include": []})
    assert resp["output"][0]["content"][0]["logprobs"] == []
    kept = create(server, {**BODY, "include": ["reasoning.encrypted_content"]})
    assert kept["output"][0]["content"][0]["logprobs"] == []


@pytest.mark.parametrize(("fields", "param"), [
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"tools": [TOOL]}, "include"),
])
def test_what_cannot_be_given_is_a_400_naming_it(server: ServerProcess, fields: dict[str, Any],
                                                 param: str) -> None:
    resp = httpx.post(server.v1 + "/responses", timeout=60, json={"model": MODEL, **BODY, **fields})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
