"""`SamplingParams.final_only` (vLLM's RequestOutputKind.FINAL_ONLY): the engine builds no
output per token for such a request, only its finished one, which equals the last output of
the same request streamed; `LLM.generate` and the server's non-streaming requests use it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from fastserve.args import engine_config
from fastserve.engine.llm_engine import LLMEngine
from fastserve.request import InvalidRequestError, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    yield LLMEngine(engine_config(dtype="float32", warmup=False, startup_profile=False,
                                  num_device_blocks=400, max_batch_size=8,
                                  enable_prefix_caching=False))


def _run_pair(engine: LLMEngine, params: SamplingParams,
              prompt: list[int]) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """The same greedy request twice in the same iterations, streamed and final-only."""
    engine.add_request(prompt, params, request_id="streamed")
    engine.add_request(prompt, replace(params, final_only=True), request_id="final")
    outs: list[RequestOutput] = []
    while engine.has_unfinished:
        outs += engine.step()
    return ([o for o in outs if o.request_id == "streamed"],
            [o for o in outs if o.request_id == "final"])


def _prompt(engine: LLMEngine, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, engine.arch.vocab_size, (24,), generator=g).tolist()


def test_a_final_only_request_gets_one_output_equal_to_the_streamed_last(
    engine: LLMEngine,
) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    streamed, final = _run_pair(engine, params, _prompt(engine, 0))
    assert len(streamed) == 20 and len(final) == 1
    last, only = streamed[-1], final[0]
    assert only.finished and only.finish_reason == "length" and only.ends_request
    assert only.token_ids == last.token_ids and len(only.token_ids) == 20
    assert only.text == last.text == "".join(o.new_text for o in streamed) != ""
    # Its one output carries everything as new: what a caller of deltas would have summed.
    assert only.new_token_ids == only.token_ids and only.new_text == only.text
    assert only.first_token_s is not None and only.first_token_s <= only.finish_s  # type: ignore[operator]


def test_a_final_only_request_still_stops_at_a_stop_string(engine: LLMEngine) -> None:
    """Stop strings are looked for as the text grows, final-only or not: both requests stop
    at the same token, the text cut before the stop string."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = _prompt(engine, 1)
    free, _ = _run_pair(engine, params, prompt)
    text = free[-1].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a few characters from mid-output
    assert stop.strip()
    streamed, final = _run_pair(engine, replace(params, stop=(stop,)), prompt)
    assert len(final) == 1 and final[0].finish_reason == streamed[-1].finish_reason == "stop"
    assert final[0].text == streamed[-1].text == text[: text.index(stop)]
    assert final[0].token_ids == streamed[-1].token_ids
    assert len(final[0].token_ids) < 24


def test_an_aborted_final_only_request_returns_what_it_generated(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, final_only=True)
    engine.add_request(_prompt(engine, 2), params, request_id="gone")
    outs: list[RequestOutput] = []
    for _ in range(6):
        outs += engine.step()
    assert outs == []  # nothing per token
    engine.abort("gone")
    while engine.has_unfinished:
        outs += engine.step()
    assert len(outs) == 1 and outs[0].finish_reason == "abort"
    assert len(outs[0].token_ids) >= 5
    assert outs[0].text == engine.tokenizer.decode(outs[0].token_ids) != ""


def test_final_only_must_be_a_bool() -> None:
    with pytest.raises(InvalidRequestError, match="final_only must be a bool, got 'yes'"):
        SamplingParams(final_only="yes")  # type: ignore[arg-type]
