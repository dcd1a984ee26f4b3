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


@pytest.mark.parametrize(("asked", "template", "splits"), [
    ("auto", "{{ '<think>' }}{{ x }}{{ '</think>' }}", True),
    ("auto", "{{ messages[0].content }}", False),
    ("none", "<think></think>", False),
    ("deepseek_r1", "{{ messages[0].content }}", True),
])
def test_auto_splits_when_the_template_thinks(asked: str, template: str, splits: bool) -> None:
    assert reasoning.choose(asked, template)[0] is splits


# -- served: a Qwen3-like template (`open`: DeepSeek-R1's, which leaves <think> open) ------------

TEMPLATE = """{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}
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


def _chat(server: ServerProcess, **body: Any) -> dict[str, Any]:
    resp = httpx.post(server.v1 + "/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": ASK, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _streamed(server: ServerProcess, **body: Any) -> tuple[str, str]:
    thinking = content = ""
    with httpx.stream("POST", server.v1 + "/chat/completions", timeout=120, json={
            "model": "tiny", "messages": ASK, "stream": True, **body}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    thinking += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    return thinking, content


def test_thinking_comes_apart_from_the_answer(thinking_server: ServerProcess) -> None:
    pytest.importorskip("xgrammar")
    assert "reasoning: <think> blocks are split" in thinking_server.log()
    forced = {"guided_regex": THOUGHT, "max_tokens": 60}
    message = _chat(thinking_server, **forced)["message"]
    assert (message["reasoning_content"], message["content"]) == ("Two and three.", "Five.")
    assert _streamed(thinking_server, **forced) == ("Two and three.", "Five.")
    # Thinking off (Qwen3's enable_thinking): the template closes an empty block; all answer.
    plain = _chat(thinking_server, max_tokens=6, chat_template_kwargs={"enable_thinking": False})
    assert "reasoning_content" not in plain["message"] and plain["message"]["content"]


def test_a_prompt_that_leaves_think_open_makes_the_output_thinking(thinking_server: ServerProcess) -> None:
    """DeepSeek-R1's template ends the prompt inside <think>: text up to </think> is thinking,
    so an output cut before it is all thinking, and a grammar holds only what follows it."""
    opened = {"chat_template_kwargs": {"open": True}, "max_tokens": 6, "ignore_eos": True,
              "temperature": 0}
    message = _chat(thinking_server, **opened)["message"]
    assert message["content"] == "" and message["reasoning_content"]
    assert _streamed(thinking_server, **opened) == (message["reasoning_content"], "")
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
    streamed = events(thinking_server, body)
    kinds = [e["type"] for e in streamed]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert streamed[-1]["response"]["output"][0]["content"][0]["text"] == item.content[0].text
    again = client.responses.create(model="tiny", max_output_tokens=2, input=[
        {"role": "user", "content": "What is 2 + 3?"}, *[i.model_dump(exclude_none=True) for i in resp.output],
        {"role": "user", "content": "And 3 + 4?"}])
    alone = client.responses.create(model="tiny", max_output_tokens=2, input=[
        {"role": "user", "content": "What is 2 + 3?"}, {"role": "user", "content": "And 3 + 4?"}])
    assert again.usage is not None and alone.usage is not None
    assert again.usage.input_tokens == alone.usage.input_tokens  # the thinking was dropped
