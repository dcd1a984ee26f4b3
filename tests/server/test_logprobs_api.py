"""Log-probabilities, echo, penalties and logit_bias through a real `fastserve serve` process,
driven by the official `openai` client; echo's prompt log-probabilities are checked against
Hugging Face's model (what lm-evaluation-harness's `local-completions` relies on)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.conftest import IS_EXACT_DTYPE
from tests.greedy import NEAR_TIE
from tests.server.helpers import ServerProcess, managed, start_server, validate

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES: list[Any] = [{"role": "user", "content": "Say something about foxes."}]
# float32: HF's log_softmax within 1e-4. In a half type (FASTSERVE_TEST_DTYPE) the server's
# logits are rounded, and two runs of one prompt may round differently (a prefix-cache hit
# computes a chunk after cached blocks): within the near-tie bound tests/greedy.py measured.
ATOL = 1e-4 if IS_EXACT_DTYPE else NEAR_TIE


@pytest.fixture(scope="module")
def server(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    yield from managed(start_server(server_tmp, "--max-batch-size", "8"))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_ready: Path) -> Any:
    from fastserve.model.tokenizer import Tokenizer

    return Tokenizer(tiny_model_ready)


def _hf_prompt_logprobs(path: Path, ids: list[int]) -> list[float]:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager")
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def test_echo_prompt_logprobs_match_hf(client: openai.OpenAI, tokenizer: Any,
                                       tiny_model_ready: Path) -> None:
    """lm-evaluation-harness's log-likelihood request: echo, max_tokens 0, logprobs 1."""
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                     logprobs=1, temperature=0)
    choice = resp.choices[0]
    ids = tokenizer.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 0
    lps = choice.logprobs
    assert lps is not None and lps.tokens is not None and lps.token_logprobs is not None
    assert lps.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lps.token_logprobs[0] is None and lps.top_logprobs is not None and lps.top_logprobs[0] is None
    ref = _hf_prompt_logprobs(tiny_model_ready, ids)
    assert max(abs(a - b) for a, b in zip(lps.token_logprobs[1:], ref)) < ATOL  # type: ignore[operator]
    for tok, lp, top in zip(lps.tokens[1:], lps.token_logprobs[1:], lps.top_logprobs[1:]):
        assert top is not None and top[tok] == lp and 1 <= len(top) <= 2
    # The text offsets place each token in the text (the BOS adds none).
    assert lps.text_offset is not None
    assert [PROMPT[o:].startswith(t) for o, t in zip(lps.text_offset[1:], lps.tokens[1:])] == \
        [True] * (len(ids) - 1)


def test_completion_logprobs_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0,
                              echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert whole.text.startswith(PROMPT)
    streamed = [lp for c in chunks for lp in (c.choices[0].logprobs.token_logprobs or [])]  # type: ignore[union-attr]
    assert whole.logprobs is not None and whole.logprobs.token_logprobs is not None
    assert len(streamed) == len(whole.logprobs.token_logprobs)
    assert streamed[0] is None and whole.logprobs.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(streamed[1:], whole.logprobs.token_logprobs[1:])) < ATOL  # type: ignore[operator]
    streamed_tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
    assert streamed_tokens == whole.logprobs.tokens
    # Greedy: each output token is the most likely of its alternatives (at most 3 + itself).
    tops = whole.logprobs.top_logprobs or []
    for tok, lp, top in list(zip(whole.logprobs.tokens or [], whole.logprobs.token_logprobs, tops))[-6:]:
        assert top is not None and len(top) <= 4 and lp == top[tok] == max(top.values())


def test_completion_logprobs_schema(server: ServerProcess, client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=0,
                                     temperature=0.8, seed=3)
    body = resp.model_dump(exclude_unset=True)
    validate(body, "CreateCompletionResponse")
    lps = resp.choices[0].logprobs
    assert lps is not None and len(lps.tokens or []) == 4
    assert all(top is not None and len(top) == 1 for top in lps.top_logprobs or [])  # itself only
    assert "".join(lps.tokens or []) == resp.choices[0].text
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2,
                                           stream=True):
        validate(chunk.model_dump(exclude_unset=True), "CreateCompletionStreamResponse")
        assert chunk.choices[0].logprobs is not None


def test_chat_logprobs_stream_and_not(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True,
                              top_logprobs=4, temperature=0)
    whole = client.chat.completions.create(**kw)
    validate(whole.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for e in content:
        assert len(e.top_logprobs) == 4 and e.logprob == e.top_logprobs[0].logprob
        assert e.bytes is not None and bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        validate(chunk.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [e.token for e in streamed] == [e.token for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < ATOL
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_logit_bias_and_penalties_steer_tokens(client: openai.OpenAI, tokenizer: Any) -> None:
    target = tokenizer.encode(" fox", add_special_tokens=False)[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                     logit_bias={str(target): 100}, logprobs=0)
    assert resp.choices[0].text == tokenizer.decode([target]) * 4
    # The same bias with a strong frequency penalty: the token cannot repeat 4 times.
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                     logit_bias={str(target): 10}, frequency_penalty=2.0,
                                     presence_penalty=2.0,
                                     extra_body={"repetition_penalty": 1.5, "min_p": 0.05})
    assert resp.choices[0].text != tokenizer.decode([target]) * 4


@pytest.mark.parametrize(("fields", "param"), [
    ({"logprobs": 21}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
])
def test_bad_values_are_400_naming_the_field(client: openai.OpenAI, fields: dict[str, Any],
                                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body=fields)  # type: ignore[call-overload]
    err = exc_info.value.body
    assert isinstance(err, dict) and err["param"] == param and param in err["message"]


def test_chat_top_logprobs_needs_logprobs(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       top_logprobs=3)
    assert isinstance(exc_info.value.body, dict) and exc_info.value.body["param"] == "top_logprobs"
