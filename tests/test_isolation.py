"""One bad request fails alone: parameters checked at admission, and a failure in one
request's sampling or detokenization fails that request while its batch gets its tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fastserve import LLM, SamplingParams
from fastserve.request import InvalidRequestError
from tests.conftest import TEST_DTYPE
from tests.faults import fails_at

PROMPT = [1, 400, 401, 402, 403, 404]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(dtype=TEST_DTYPE, max_batch_size=8, warmup=False, kv_cache_gib=0.125) as llm:
        yield llm


def _greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def test_a_temperature_too_small_to_divide_by_samples_greedily(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], _greedy(), use_tqdm=False)[0]
    tiny = SamplingParams(max_tokens=NUM_TOKENS, temperature=1e-300, ignore_eos=True)
    assert tiny.temperature == 0.0 and tiny.is_greedy
    assert llm.generate([PROMPT], tiny, use_tqdm=False)[0].token_ids == greedy.token_ids


def test_top_k_beyond_the_vocabulary_means_no_top_k(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, seed=3, ignore_eos=True)
    huge = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, seed=3, ignore_eos=True,
                          top_k=1180591620717411303424)
    outs = llm.generate([PROMPT, PROMPT], [plain, huge], use_tqdm=False)
    assert outs[0].token_ids == outs[1].token_ids


def test_a_top_p_below_float32s_range_keeps_the_top_token(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], _greedy(), use_tqdm=False)[0]
    tiny = SamplingParams(max_tokens=NUM_TOKENS, top_p=5e-324, ignore_eos=True)  # found by schemathesis
    assert llm.generate([PROMPT], tiny, use_tqdm=False)[0].token_ids == greedy.token_ids


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"stop_token_ids": [1000000000], "min_tokens": 2}, "stop_token_ids"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"top_k": True}, "top_k"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(llm: LLM, kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError, match=param) as info:
        llm.engine.add_request(PROMPT, SamplingParams(max_tokens=4, **kwargs))
    assert info.value.param == param
    assert not llm.engine.has_unfinished


def test_text_that_is_not_unicode_is_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="not valid Unicode") as info:
        llm.engine.add_request("\ud800x", SamplingParams(max_tokens=4))
    assert info.value.param == "prompt"


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_a_fault_in_one_requests_sampling_fails_only_that_request(llm: LLM, how: str) -> None:
    reference = llm.generate([PROMPT], _greedy(), use_tqdm=False)[0].token_ids
    seeded = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, seed=11, ignore_eos=True)
    seeded_alone = llm.generate([PROMPT], seeded, use_tqdm=False)[0].token_ids
    faulty = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, ignore_eos=True,
                            logits_processors=[fails_at(3, how)])
    engine = llm.engine
    outs = llm.generate([PROMPT] * 4, [_greedy(), faulty, seeded, _greedy()], use_tqdm=False)
    assert engine.core.num_iterations > 0
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert outs[0].token_ids == reference and outs[3].token_ids == reference
    assert outs[2].token_ids == seeded_alone  # the fallback draw kept its generator in step
    assert len(outs[1].token_ids) == 3 and "sampling failed" in (outs[1].error or "")
    assert engine.scheduler.kv._kv.num_free_blocks == engine.scheduler.kv._kv.num_total_blocks
