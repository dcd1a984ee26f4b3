"""Speculative decoding on the real engine: drafts from a prediction (OpenAI's Predicted
Outputs) or from the request's own tokens (ngram) are verified in one forward pass, and the
output is the one decoding token by token gives, in fewer iterations."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastserve import SamplingParams
from fastserve.args import engine_config
from fastserve.engine.core import AsyncEngineCore
from fastserve.engine.llm_engine import LLMEngine
from tests.conftest import IS_EXACT_DTYPE, TEST_DTYPE
from tests.engine_runs import record_launches, run_to_end
from tests.greedy import GreedyReference, assert_same_greedy_tokens

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(**kw: object) -> LLMEngine:
    opts: dict[str, object] = dict(dtype=TEST_DTYPE, max_batch_size=4, block_size=4,
                                   num_device_blocks=200, warmup=False, startup_profile=False)
    opts.update(kw)
    return LLMEngine(engine_config(**opts))


def _prompts(vocab: int, lens: tuple[int, ...] = (5, 19, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def plain() -> LLMEngine:
    return _engine()


@pytest.fixture(scope="module")
def reference(plain: LLMEngine) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts and their greedy outputs, decoded one token per iteration."""
    prompts = _prompts(plain.arch.vocab_size)
    outs = run_to_end(plain, prompts, [GREEDY] * len(prompts))
    return prompts, [o.token_ids for o in outs]


def test_a_prediction_gives_the_same_tokens_in_fewer_iterations(
        plain: LLMEngine, reference: tuple[list[list[int]], list[list[int]]],
        greedy_reference: GreedyReference) -> None:
    prompts, want = reference
    params = [dataclasses.replace(GREEDY, prediction_token_ids=w) for w in want]
    before = plain.core.num_iterations
    outs = run_to_end(plain, prompts, params)
    iterations = plain.core.num_iterations - before
    assert_same_greedy_tokens([o.token_ids for o in outs], want, prompts, greedy_reference)
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    assert drafted > 0
    if IS_EXACT_DTYPE:
        # The prediction is the output itself: every draft is the model's token. 1 prefill +
        # 23 tokens in steps of up to 1 + 5: 6 iterations, against 24 without drafts.
        assert accepted == drafted
        assert iterations <= 8, iterations
    # NOTE: in a half type a drafted position's logits round otherwise than a decode's, so a
    # near-tie may go the other way and the output leave the prediction from there on.


def test_prediction_text_is_tokenized_and_followed(plain: LLMEngine) -> None:
    prompt = plain.tokenizer.encode("a prediction is tokenized as the engine adds it")
    out = run_to_end(plain, [prompt], [GREEDY])[0]
    predicted = dataclasses.replace(GREEDY, prediction=plain.tokenizer.decode(out.token_ids, True))
    again = run_to_end(plain, [prompt], [predicted])[0]
    assert again.token_ids == out.token_ids or not IS_EXACT_DTYPE
    assert again.num_draft_tokens > 0
    assert 0 <= again.num_accepted_tokens <= again.num_draft_tokens


def test_ngram_drafts_give_the_same_tokens(
        plain: LLMEngine, reference: tuple[list[list[int]], list[list[int]]],
        greedy_reference: GreedyReference) -> None:
    """Whether a random model's output repeats its own tokens is up to its weights, so the
    lookups themselves are checked in tests/core/test_drafter.py; here, a prompt that
    holds its continuation twice (as code being edited does) and the plain prompts decode as
    they do one token at a time."""
    prompts, want = reference
    looped = [*prompts[1], *want[1], *prompts[1], *want[1], *prompts[1]]
    looped_want = run_to_end(plain, [looped], [GREEDY])[0].token_ids
    engine = _engine(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    plans = record_launches(engine)
    outs = run_to_end(engine, [*prompts, looped], [GREEDY] * 4)
    assert_same_greedy_tokens([o.token_ids for o in outs], [*want, looped_want],
                              [*prompts, looped], greedy_reference)
    drafting = [s for p in plans for s in p.scheduled if s.num_draft_tokens]
    assert all(s.num_draft_tokens <= 3 for s in drafting)
    assert sum(o.num_draft_tokens for o in outs) == sum(s.num_draft_tokens for s in drafting)


def test_drafts_stop_at_max_tokens_and_stop_tokens(
        plain: LLMEngine, reference: tuple[list[list[int]], list[list[int]]]) -> None:
    prompts, want = reference
    w = want[2]
    stop_at = next(i for i in range(3, len(w)) if w[i] not in w[:i])  # its first occurrence
    params = [dataclasses.replace(GREEDY, max_tokens=7, prediction_token_ids=w),
              dataclasses.replace(GREEDY, stop_token_ids=(w[stop_at],), prediction_token_ids=w)]
    short, stopped = run_to_end(plain, [prompts[2], prompts[2]], params)
    assert len(short.token_ids) == 7 and short.finish_reason == "length"
    if IS_EXACT_DTYPE:
        assert short.token_ids == w[:7]
        assert stopped.token_ids == w[: stop_at + 1] and stopped.finish_reason == "stop"
    else:  # a near-tie may take the output off the prediction before the stop token
        stop = w[stop_at]
        assert (stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop) or (
            stopped.finish_reason == "length" and len(stopped.token_ids) == GREEDY.max_tokens)
        assert stop not in stopped.token_ids[:-1]
    assert plain.scheduler.kv._kv.num_requests == 0
    assert plain.scheduler.kv._kv.num_free_blocks == plain.scheduler.kv._kv.num_total_blocks  # drafts' blocks came back


def test_requests_that_cannot_draft_run_beside_drafting_ones(
        plain: LLMEngine, reference: tuple[list[list[int]], list[list[int]]]) -> None:
    """The caller's logits processors see each sampled row: such a request decodes one token
    per iteration, in the same batches as requests verifying drafts."""
    prompts, want = reference
    plans = record_launches(plain)
    seen: list[int] = []

    def count(num_output_tokens: int, logits: torch.Tensor) -> torch.Tensor:
        seen.append(num_output_tokens)
        return logits

    params = [dataclasses.replace(GREEDY, prediction_token_ids=want[0]),
              dataclasses.replace(GREEDY, prediction_token_ids=want[1], logits_processors=(count,))]
    outs = run_to_end(plain, prompts[:2], params)
    assert outs[0].num_draft_tokens > 0 and outs[1].num_draft_tokens == 0
    assert seen == list(range(len(outs[1].token_ids)))  # once per token, in order
    mixed = [p for p in plans if len({s.num_draft_tokens > 0 for s in p.scheduled}) == 2]
    assert mixed, "no batch held a drafting request beside one that does not draft"


def test_accepted_drafts_carry_the_log_probabilities_of_decoding_one_at_a_time(
        plain: LLMEngine, reference: tuple[list[list[int]], list[list[int]]]) -> None:
    """Each token a verification gives (accepted drafts and the model's next) has its entry:
    the raw logits' log-probability and top alternatives at its position, as a decode step's;
    a stop token inside the accepted drafts ends the entries with the tokens."""
    prompts, want = reference
    asks = dataclasses.replace(GREEDY, logprobs=3)
    stop = dataclasses.replace(asks, stop_token_ids=(want[1][9],), ignore_eos=False)
    one_at_a_time = run_to_end(plain, prompts[:2], [asks, stop])
    drafted = run_to_end(plain, prompts[:2], [dataclasses.replace(p, prediction_token_ids=w)
                                              for p, w in zip([asks, stop], want)])
    assert drafted[0].num_accepted_tokens > 0 and drafted[1].num_accepted_tokens > 0
    for got, base in zip(drafted, one_at_a_time, strict=True):
        assert got.logprobs is not None and base.logprobs is not None
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        assert all(len(lp.top) == 3 for lp in got.logprobs)
        if IS_EXACT_DTYPE:  # half types may part at a near-tie
            assert got.token_ids == base.token_ids
            for g, b in zip(got.logprobs, base.logprobs, strict=True):
                assert abs(g.logprob - b.logprob) < 1e-3, (g, b)
                assert [t for t, _ in g.top] == [t for t, _ in b.top]
    if IS_EXACT_DTYPE:
        assert len(drafted[1].token_ids) == 10 and drafted[1].finish_reason == "stop"


def test_penalties_and_bad_words_count_the_drafts_before_each_position(
        plain: LLMEngine, reference: tuple[list[list[int]], list[list[int]]]) -> None:
    """A drafted position is penalized for the drafts before it as for output tokens: with
    the penalized outputs as predictions, the tokens are those decoded one at a time."""
    prompts, want = reference
    w = want[2]
    penalized = [dataclasses.replace(GREEDY, presence_penalty=1.5, frequency_penalty=0.5),
                 dataclasses.replace(GREEDY, repetition_penalty=1.3),
                 dataclasses.replace(GREEDY, bad_words_token_ids=((w[3], w[4]), (w[9],)))]
    one_at_a_time = [o.token_ids for o in run_to_end(plain, [prompts[2]] * 3, penalized)]
    assert w[:5] != one_at_a_time[2][:5]  # the bad words changed the output
    predicted = [dataclasses.replace(p, prediction_token_ids=o)
                 for p, o in zip(penalized, one_at_a_time)]
    outs = run_to_end(plain, [prompts[2]] * 3, predicted)
    banned = outs[2].token_ids
    assert w[9] not in banned
    assert all(banned[i : i + 2] != [w[3], w[4]] for i in range(len(banned) - 1))
    if IS_EXACT_DTYPE:
        assert [o.token_ids for o in outs] == one_at_a_time
        assert all(o.num_accepted_tokens > 10 for o in outs)
    else:  # the penalized argmax has no float32 reference to compare near-ties with
        assert all(o.num_draft_tokens > 0 for o in outs)


def test_seeded_sampling_with_a_prediction_is_repeatable(
        plain: LLMEngine, reference: tuple[list[list[int]], list[list[int]]]) -> None:
    prompts, want = reference
    params = SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=3, ignore_eos=True,
                            prediction_token_ids=want[0])
    first = run_to_end(plain, [prompts[0]], [params])[0]
    second = run_to_end(plain, [prompts[0]], [params])[0]
    assert first.token_ids == second.token_ids and len(first.token_ids) == 16
    assert all(0 <= t < plain.arch.vocab_size for t in first.token_ids)


def test_a_prediction_outside_the_vocabulary_is_refused(plain: LLMEngine) -> None:
    bad = dataclasses.replace(GREEDY, prediction_token_ids=(1, plain.arch.vocab_size))
    with pytest.raises(ValueError, match="prediction_token_ids"):
        plain.add_request([5, 6, 7], bad)


def test_predictions_draft_under_async_scheduling(
        reference: tuple[list[list[int]], list[list[int]]],
        greedy_reference: GreedyReference) -> None:
    """The next plan is scheduled while a batch runs; a request with a prediction sits that
    plan out so that its draft can follow its last token. One whose prediction finds nothing
    stops waiting after a few steps, and one with none runs ahead as usual."""
    prompts, want = reference
    engine = _engine(async_scheduling=True)
    assert isinstance(engine.core, AsyncEngineCore)
    vocab = engine.arch.vocab_size
    unrelated = [(7 * j + 3) % (vocab - 10) + 10 for j in range(24)]
    params = [dataclasses.replace(GREEDY, prediction_token_ids=want[0]),
              dataclasses.replace(GREEDY, prediction_token_ids=unrelated),
              GREEDY]
    outs = run_to_end(engine, prompts, params)
    assert_same_greedy_tokens([o.token_ids for o in outs], want, prompts, greedy_reference)
    assert outs[0].num_accepted_tokens > 10
    assert outs[2].num_draft_tokens == 0
