"""What the sampling process computes, with the model split across processes (gloo on CPU):
log-probabilities (sampled and prompt, of decoded and of verified drafted tokens) and best_of
come back from the sampler rank, a worker's under pipeline parallelism, as on one device. Structured output runs with both (a pipeline's
driver, which holds the grammars, sends the batch's masks to the worker that samples); offline
logits processors run where the driver samples (tensor parallelism) and are refused, naming
the field, under pipeline parallelism."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest
import torch

from fastserve import LLM, SamplingParams
from fastserve.request import InvalidRequestError, RequestOutput, StructuredOutputParams
from tests.conftest import IS_EXACT_DTYPE, TEST_DTYPE

PROMPT_LENS = [5, 17, 40]
LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                          prompt_logprobs=2)
BEST_OF = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, n=1, best_of=3)
# How far a split model's log-probabilities may be from one device's: it sums its shards in
# another order (bfloat16 on this CPU: 0.17 at -11, 4% of the value at most).
ABS_TOL, REL_TOL = (1e-3, 0.0) if IS_EXACT_DTYPE else (0.3, 0.03)


def _llm(tp: int = 1, pp: int = 1) -> LLM:
    return LLM(dtype=TEST_DTYPE, warmup=False, startup_profile=False, tensor_parallel_size=tp,
               pipeline_parallel_size=pp, worker_timeout_s=60.0, max_batch_size=8,
               kv_cache_gib=0.05)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(llm: LLM, predictions: list[list[int]] | None = None) -> list[RequestOutput]:
    """The logprobs requests (drafting from `predictions`, if given), beside one without, and
    a best_of request, in one batch."""
    prompts = _prompts()
    plain = dataclasses.replace(LOGPROBS, logprobs=None, prompt_logprobs=None)
    asks = [LOGPROBS] * len(prompts) if predictions is None else [
        dataclasses.replace(LOGPROBS, prediction_token_ids=p) for p in predictions]
    return llm.generate([*prompts, prompts[0], prompts[1]], [*asks, plain, BEST_OF],
                        use_tqdm=False)


@pytest.fixture(scope="module")
def reference() -> list[RequestOutput]:
    llm = _llm()
    try:
        return _run(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["tp2", "pp2"])
def split(request: pytest.FixtureRequest) -> Iterator[tuple[LLM, int]]:
    tp, pp = request.param
    llm = _llm(tp, pp)
    try:
        yield llm, pp
    finally:
        llm.shutdown()


def _close(got: float, want: float) -> None:
    assert abs(got - want) <= ABS_TOL + REL_TOL * abs(want), (got, want)


@pytest.mark.parametrize("drafted", [False, True], ids=["decoded", "drafted"])
def test_logprobs_and_best_of_come_back_as_on_one_device(
        split: tuple[LLM, int], reference: list[RequestOutput], drafted: bool) -> None:
    """Drafted: the reference's outputs as predictions, so that tokens come from verified
    drafts, each with its log-probabilities, as decoding gave them one at a time."""
    wanted = [r.token_ids for r in reference[: len(PROMPT_LENS)]]
    outs = _run(split[0], wanted if drafted else None)
    if drafted and IS_EXACT_DTYPE:
        assert all(o.num_accepted_tokens > 0 for o in outs[: len(PROMPT_LENS)])
    for got, want in zip(outs[: len(PROMPT_LENS)], reference, strict=False):
        # The prompt's: teacher-forced, so comparable in any dtype.
        assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
        for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert g is not None and w is not None and g.token_id == w.token_id
            _close(g.logprob, w.logprob)
            assert len(g.top) == 2
        # The sampled tokens': one each, with 3 alternatives.
        assert got.logprobs is not None and len(got.logprobs) == len(got.token_ids) == 6
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        assert all(len(lp.top) == 3 and lp.top[0][1] >= lp.top[-1][1] for lp in got.logprobs)
        assert want.logprobs is not None
        _close(got.logprobs[0].logprob, want.logprobs[0].logprob)  # the same prompt before it
        if IS_EXACT_DTYPE:  # half types may part at a near-tie
            assert got.token_ids == want.token_ids
            for g, w in zip(got.logprobs, want.logprobs, strict=True):
                _close(g.logprob, w.logprob)
                assert [t for t, _ in g.top] == [t for t, _ in w.top]
    plain, best = outs[len(PROMPT_LENS):]
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert len(best.outputs) == 1 and len(best.token_ids) == 6
    if IS_EXACT_DTYPE:  # the same seeded candidates, ranked by the same scores
        assert best.token_ids == reference[-1].token_ids


def test_grammars_and_logits_processors(split: tuple[LLM, int]) -> None:
    llm, pp = split
    allowed = [11, 12, 13]

    def only_allowed(num_output_tokens: int, logits: torch.Tensor) -> torch.Tensor:
        keep = torch.full_like(logits, float("-inf"))
        keep[allowed] = 0.0
        return logits + keep

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    structured = StructuredOutputParams("json", json.dumps(schema), "guided_json")
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    cases = [dataclasses.replace(greedy, logits_processors=(only_allowed,), ignore_eos=True,
                                 max_tokens=5),
             dataclasses.replace(greedy, structured_output=structured)]
    if pp > 1:  # a worker samples: the caller's own code cannot run there
        with pytest.raises(InvalidRequestError, match="pipeline parallelism") as err:
            llm.generate("Hello", cases[0], use_tqdm=False)
        assert err.value.param == "logits_processors"
    else:
        (banned,) = llm.generate(["Hello"], cases[:1], use_tqdm=False)
        assert banned.token_ids and set(banned.token_ids) <= set(allowed)
    pytest.importorskip("xgrammar")
    # Several at once, beside a free request, sampled: each output its schema's.
    shaped = llm.generate(["Answer in JSON:"] * 3 + ["Hello"], [
        dataclasses.replace(cases[1], temperature=1.0, seed=i) for i in range(3)] + [greedy],
        use_tqdm=False)
    for out in shaped[:3]:
        assert out.finish_reason == "stop", out
        assert json.loads(out.text)["ok"] in (True, False)
    # A schema that is no grammar fails its request alone (400 before it runs).
    with pytest.raises(InvalidRequestError):
        llm.generate("x", dataclasses.replace(greedy, structured_output=StructuredOutputParams(
            "json", '{"type": "nonsense"}', "guided_json")), use_tqdm=False)
