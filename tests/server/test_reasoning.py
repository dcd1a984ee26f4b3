"""Reasoning models' thinking (`--reasoning-parser`): the `<think>` block split from the answer,
read whole and streamed alike, as chat's `reasoning_content` and the Responses API's reasoning
item; whether an output begins inside its thinking is read off the prompt."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fastserve.server import reasoning
from fastserve.server.reasoning import ReasoningParser
from tests.conftest import IS_EXACT_DTYPE
from tests.server.helpers import ServerProcess, managed, start_server, with_template
from tests.server.test_responses_api import events

CASES = [  # (output, the prompt left <think> open, thinking, answer)
    ("<think>Let me see.</think>\n\nAnswer.", False, "Let me see.", "Answer."),
    ("\n<think>\nhmm\n</think>Answer.", False, "\nhmm\n", "Answer."),
    ("Just an answer, <think> and all.", False, None, "Just an answer, <think> and all."),
    ("Let me see.</think>Answer.", True, "Let me see.", "Answer."),
    ("<think>Let me see.</think>Answer.", True, "Let me see.", "Answer."),  # it opened it again
    ("cut short before the end", True, "cut short before the end", ""),
    ("<think>cut short", False, "cut short", ""),
    ("<think></think>Answer.", False, "", "Answer."),
    ("<thi", False, None, "<thi"),
    ("\n\n", False, None, "\n\n"),
]


@pytest.mark.parametrize(("text", "inside", "thinking", "answer"), CASES)
def test_whole_and_streamed_outputs_split_alike(text: str, inside: bool, thinking: str | None,
                                                answer: str) -> None:
    assert ReasoningParser(inside).split(text) == (thinking, answer)
    for pieces in [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]:
        parser = ReasoningParser(inside)
        got = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert ("".join(t for t, _ in got), "".join(a for _, a in got)) == (thinking or "", answer)


PIECES = ["<think>", "Two", " and", "</", "think", ">", "\n", "Five", "."]


@pytest.mark.parametrize(("ids", "inside", "num_thinking"), [
    ([0, 1, 2, 3, 4, 5, 6, 7, 8], False, 6),  # up to the token that completes </think>
    ([1, 2, 3, 4, 5, 7], True, 5),  # the prompt left <think> open
    ([0, 1, 2], False, 3),  # not closed yet: all thinking
    ([1, 2], True, 2),
    ([7, 8], False, 0),  # no thinking
    ([7, 3, 4, 5], False, 0),  # a stray </think> in an answer
    ([], True, 0),
])
def test_reasoning_tokens_are_counted_up_to_the_end_of_thinking(ids: list[int], inside: bool,
                                                               num_thinking: int) -> None:
    def decode(some: Any) -> str:
        return "".join(PIECES[i] for i in some)
    assert reasoning.count_tokens(ids, inside, decode) == num_thinking


@pytest.mark.parametrize(("asked", "template", "splits"), [
    ("auto", "{{ '<think>' }}{{ x }}{{ '</think>' }}", True),
    ("auto", "{{ messages[0].content }}", False),
    ("none", "<think></think>", False),
    ("deepseek_r1", "{{ messages[0].content }}", True),
])
def test_auto_splits_when_the_template_thinks(asked: str, template: str, splits: bool) -> None:
    assert reasoning.choose(asked, template)[0] is splits


# -- served: a Qwen3-like template (`open`: DeepSeek-R1's, which leaves <think> open) ------------

TEMPLATE = """{%- if reasoning_effort is defined %}{{- 'Reasoning: ' + reasoning_effort + '\\n' }}{%- endif %}
{%- for doc in documents or [] %}{{- 'Document ' + doc.title + ': ' + doc.text + '\\n' }}{%- endfor %}
{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.role == 'assistant' and message.reasoning_content %}
{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- elif (open is defined and open) or messages[-1].content.endswith('/think') %}
{{- '<think>\\n' }}{%- endif %}{%- endif %}"""
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
THOUGHT = r"<think>Two and three\.</think>\n\nFive\."


@pytest.fixture(scope="module")
def thinking_server(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    model = with_template(server_tmp, tiny_model_ready, "tiny-think-template", TEMPLATE)
    yield from managed(start_server(server_tmp, str(model), "--served-model-name", "tiny",
                                    "--no-warmup", "--no-startup-profile"))


def _whole(server: ServerProcess, **body: Any) -> dict[str, Any]:
    resp = httpx.post(server.v1 + "/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": ASK, **body})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _chat(server: ServerProcess, **body: Any) -> dict[str, Any]:
    return dict(_whole(server, **body)["choices"][0])


def _reasoning_tokens(usage: dict[str, Any]) -> int:
    return int(usage["completion_tokens_details"]["reasoning_tokens"])


def _streamed(server: ServerProcess, **body: Any) -> tuple[str, str]:
    return _streamed_with_usage(server, **body)[:2]


def _streamed_with_usage(server: ServerProcess, **body: Any) -> tuple[str, str, dict[str, Any]]:
    thinking = content = ""
    usage: dict[str, Any] = {}
    with httpx.stream("POST", server.v1 + "/chat/completions", timeout=120, json={
            "model": "tiny", "messages": ASK, "stream": True,
            "stream_options": {"include_usage": True}, **body}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    thinking += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    return thinking, content, usage


def test_thinking_comes_apart_from_the_answer(thinking_server: ServerProcess) -> None:
    pytest.importorskip("xgrammar")
    assert "reasoning: <think> blocks are split" in thinking_server.log()
    forced = {"guided_regex": THOUGHT, "max_tokens": 60}
    whole = _whole(thinking_server, **forced, return_token_ids=True)
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Two and three.", "Five.")
    assert _streamed(thinking_server, **forced) == ("Two and three.", "Five.")
    # usage: the thinking's tokens, </think> included, are those before the answer's.
    ids = whole["choices"][0]["token_ids"]
    num_thinking = _reasoning_tokens(whole["usage"])
    assert 0 < num_thinking < len(ids) == whole["usage"]["completion_tokens"]
    thought = httpx.post(thinking_server.url + "/detokenize", timeout=60,
                         json={"model": "tiny", "tokens": ids[:num_thinking]}).json()["prompt"]
    assert thought.endswith("</think>")
    # Thinking off (Qwen3's enable_thinking): the template closes an empty block; all answer.
    plain = _whole(thinking_server, max_tokens=6, chat_template_kwargs={"enable_thinking": False})
    assert "reasoning_content" not in plain["choices"][0]["message"]
    assert plain["choices"][0]["message"]["content"] and _reasoning_tokens(plain["usage"]) == 0


def test_a_prompt_that_leaves_think_open_makes_the_output_thinking(thinking_server: ServerProcess) -> None:
    """DeepSeek-R1's template ends the prompt inside <think>: text up to </think> is thinking,
    so an output cut before it is all thinking, and a grammar holds only what follows it."""
    opened = {"chat_template_kwargs": {"open": True}, "max_tokens": 6, "ignore_eos": True,
              "temperature": 0}
    whole = _whole(thinking_server, **opened)
    message = whole["choices"][0]["message"]
    assert message["content"] == "" and message["reasoning_content"]
    assert _reasoning_tokens(whole["usage"]) == 6  # all of them
    thinking, content, usage = _streamed_with_usage(thinking_server, **opened)
    assert (thinking, content, _reasoning_tokens(usage)) == (message["reasoning_content"], "", 6)
    # A grammar begins after </think>: the thinking stays free (the same greedy text).
    pytest.importorskip("xgrammar")
    held = _chat(thinking_server, **opened, response_format={"type": "json_object"})["message"]
    assert held == message


def test_a_call_after_thinking_is_read_from_the_answer(thinking_server: ServerProcess) -> None:
    pytest.importorskip("xgrammar")
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    call = r'<tool_call>\n\{"name": "add", "arguments": \{"a": 2, "b": 3\}\}\n</tool_call>'
    choice = _chat(thinking_server, tools=[tool], max_tokens=80,
                   guided_regex=r"<think>Use add\.</think>\n\n" + call)
    assert choice["message"]["reasoning_content"] == "Use add."
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": 2, "b": 3}'


def test_the_responses_api_has_a_reasoning_item(thinking_server: ServerProcess) -> None:
    """A prompt left inside <think> (the template's `/think` switch, as Qwen3's): the output,
    cut short, is a reasoning item, whole or streamed; sent back as input it is dropped."""
    client = openai.OpenAI(base_url=thinking_server.v1, api_key="none", max_retries=0)
    body = {"model": "tiny", "input": "What is 2 + 3? /think", "max_output_tokens": 6,
            "temperature": 0}
    resp = client.responses.create(**body)
    (item,) = resp.output
    assert item.type == "reasoning" and item.content and item.content[0].text
    assert resp.status == "incomplete"
    assert resp.usage is not None and resp.usage.output_tokens_details.reasoning_tokens == 6
    streamed = events(thinking_server, body)
    kinds = [e["type"] for e in streamed]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    text = streamed[-1]["response"]["output"][0]["content"][0]["text"]
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta") \
        == next(e["text"] for e in streamed if e["type"] == "response.reasoning_text.done") == text
    # NOTE: the stream's prompt is served from the prefix cache, whose blocks a half type
    # rounds otherwise than a fresh prefill (a greedy near-tie may then go the other way:
    # bfloat16 on an AMX Xeon did, before this session's changes too).
    assert text == item.content[0].text or not IS_EXACT_DTYPE
    again = client.responses.create(model="tiny", max_output_tokens=2, input=[
        {"role": "user", "content": "What is 2 + 3?"}, *[i.model_dump(exclude_none=True) for i in resp.output],
        {"role": "user", "content": "And 3 + 4?"}])
    alone = client.responses.create(model="tiny", max_output_tokens=2, input=[
        {"role": "user", "content": "What is 2 + 3?"}, {"role": "user", "content": "And 3 + 4?"}])
    assert again.usage is not None and alone.usage is not None
    assert again.usage.input_tokens == alone.usage.input_tokens  # the thinking was dropped


def test_the_effort_reaches_a_template_that_reads_it(thinking_server: ServerProcess) -> None:
    """chat's reasoning_effort and the Responses API's reasoning.effort are the template's
    `reasoning_effort` (gpt-oss's reads it): the prompt says it."""
    plain = _whole(thinking_server, max_tokens=1)["usage"]["prompt_tokens"]
    high = _whole(thinking_server, max_tokens=1, reasoning_effort="high")["usage"]["prompt_tokens"]
    assert high > plain
    counted = httpx.post(thinking_server.url + "/tokenize", timeout=60, json={
        "messages": ASK, "reasoning_effort": "high"}).json()["count"]
    assert counted == high
    client = openai.OpenAI(base_url=thinking_server.v1, api_key="none", max_retries=0)
    resp = client.responses.create(model="tiny", input=ASK[0]["content"], max_output_tokens=1,
                                   reasoning={"effort": "high"})
    assert resp.usage is not None and resp.usage.input_tokens == high


def test_include_reasoning_false_leaves_the_thinking_out(thinking_server: ServerProcess) -> None:
    """vLLM's include_reasoning: false answers without the thinking (whole, streamed, and the
    Responses API's reasoning item); its tokens still count as reasoning tokens."""
    pytest.importorskip("xgrammar")
    forced = {"guided_regex": THOUGHT, "max_tokens": 60}
    whole = _whole(thinking_server, **forced, include_reasoning=False)
    message = whole["choices"][0]["message"]
    assert message["content"] == "Five." and "reasoning_content" not in message
    assert _reasoning_tokens(whole["usage"]) > 0
    assert _streamed(thinking_server, **forced, include_reasoning=False) == ("", "Five.")
    # A prompt left inside <think>, cut short: all thinking, so no item at all.
    resp = httpx.post(thinking_server.v1 + "/responses", timeout=120, json={
        "model": "tiny", "input": "What is 2 + 3? /think", "max_output_tokens": 6,
        "temperature": 0, "include_reasoning": False})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert all(item["type"] != "reasoning" for item in body["output"]), body
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 6


def test_documents_reach_the_chat_template(thinking_server: ServerProcess) -> None:
    """vLLM's documents (retrieval-augmented generation): the template's `documents`."""
    docs = [{"title": "Rivers", "text": "The Nile is long."}]
    whole = _whole(thinking_server, max_tokens=1, documents=docs, return_token_ids=True)
    prompt = httpx.post(thinking_server.url + "/detokenize", timeout=60, json={
        "model": "tiny", "tokens": whole["prompt_token_ids"]}).json()["prompt"]
    assert "Document Rivers: The Nile is long." in prompt
    plain = _whole(thinking_server, max_tokens=1)["usage"]["prompt_tokens"]
    assert whole["usage"]["prompt_tokens"] > plain
    bad = httpx.post(thinking_server.v1 + "/chat/completions", timeout=60, json={
        "model": "tiny", "messages": ASK, "documents": [{"title": 3}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("documents"), bad.text


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/chat/completions", {"messages": ASK, "reasoning_effort": "low"}, "reasoning_effort"),
    ("/responses", {"input": "hi", "reasoning": {"effort": "low"}}, "reasoning.effort"),
    ("/responses", {"input": "hi", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ("/chat/completions", {"messages": ASK, "reasoning_effort": "huge"}, "reasoning_effort"),
])
def test_an_effort_the_template_ignores_is_refused(server: ServerProcess, path: str,
                                                   fields: dict[str, Any], param: str) -> None:
    """As OpenAI answers it for a model that does not reason: a 400 naming the field, not a
    silently unchanged prompt (the tiny model's template has no effort)."""
    resp = httpx.post(server.v1 + path, timeout=60, json={"model": "tiny", "max_tokens": 1, **fields}
                      if path == "/chat/completions" else {"model": "tiny", "max_output_tokens": 1,
                                                           **fields})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
