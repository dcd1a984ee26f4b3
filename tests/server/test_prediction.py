"""OpenAI's Predicted Outputs through the SDK: chat's `prediction` leaves the answer as it is
and reports the drafted tokens the model kept and those it did not in usage's
completion_tokens_details."""

from __future__ import annotations

import httpx
import openai

from tests.server.helpers import ServerProcess

MODEL = "tiny"
ASK = [{"role": "user", "content": "Rewrite this with nothing changed: the cat sat on the mat"}]


def test_a_prediction_changes_nothing_but_the_usage_it_reports(
        client: openai.OpenAI, server: ServerProcess) -> None:
    before = server.metrics()
    plain = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,  # type: ignore[arg-type]
                                           max_completion_tokens=24, logprobs=True, top_logprobs=2)
    text = plain.choices[0].message.content
    assert text
    predicted = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_completion_tokens=24,  # type: ignore[arg-type]
        prediction={"type": "content", "content": text}, logprobs=True, top_logprobs=2)
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details if predicted.usage else None
    assert details is not None and details.accepted_prediction_tokens
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens is not None
    # Every token has its log-probabilities, drafted or not, as without the prediction.
    got, want = predicted.choices[0].logprobs, plain.choices[0].logprobs
    assert got is not None and got.content is not None and want is not None and want.content
    assert predicted.usage is not None and len(got.content) == predicted.usage.completion_tokens
    for g, w in zip(got.content, want.content, strict=True):
        assert g.token == w.token and len(g.top_logprobs) == 2
        assert abs(g.logprob - w.logprob) < 0.3, (g, w)  # any dtype the server runs
    # Text parts are put together as they are; a stream reports it in its usage chunk.
    half = len(text) // 2
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_completion_tokens=24, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
        prediction={"type": "content", "content": [{"type": "text", "text": text[:half]},
                                                   {"type": "text", "text": text[half:]}]}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.accepted_prediction_tokens
    after = server.metrics()
    kept = "fastserve_spec_decode_accepted_tokens_total"
    assert after[kept] - before.get(kept, 0.0) >= 2 * details.accepted_prediction_tokens
    assert after["fastserve_spec_decode_draft_tokens_total"] >= after[kept]


def test_a_prediction_of_another_type_is_refused(server: ServerProcess) -> None:
    resp = httpx.post(server.v1 + "/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "prediction": {"type": "file", "content": "x"}})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "prediction.type"
