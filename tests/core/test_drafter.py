"""Drafts for speculative decoding (`fastserve.core.speculative`) and how the scheduler plans
them: pure Python, no model."""

from __future__ import annotations

import itertools

from fastserve.config import SpeculativeConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.plan import ExecutorOutput
from fastserve.core.speculative import Drafter
from fastserve.request import Request, SamplingParams
from tests.core.factories import UNIT_COST, make_scheduler

_ids = itertools.count()


def _req(prompt: list[int], output: list[int], **params: object) -> Request:
    req = Request(f"r{next(_ids)}", list(prompt), SamplingParams(max_tokens=64, **params), 0.0)  # type: ignore[arg-type]
    req.output_token_ids = list(output)
    return req


def test_ngram_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    drafter = Drafter(SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1))
    # ... 7 8 9 then 1 2 3 4 5 ... 2 3: the suffix "2 3" was followed by 4 5 6.
    req = _req([7, 8, 9, 1, 2, 3, 4, 5, 6, 1, 9, 2], [3])
    assert drafter.propose(req, 8) == [4, 5, 6]
    assert drafter.propose(req, 2) == [4, 5]  # the step's own limit
    # Only one token matches anywhere: the shortest lookup (1) finds it.
    assert drafter.propose(_req([5, 6, 7], [5]), 8) == [6, 7, 5]
    assert drafter.propose(_req([5, 6, 7], [8]), 8) == []  # never seen before


def test_ngram_needs_the_minimum_suffix() -> None:
    drafter = Drafter(SpeculativeConfig("ngram", prompt_lookup_min=2, prompt_lookup_max=3))
    assert drafter.propose(_req([1, 2, 3, 4], [2]), 5) == []  # "4 2" never occurred
    assert drafter.propose(_req([1, 2, 3, 4, 1], [2]), 5)[:2] == [3, 4]


def test_a_prediction_is_followed_and_found_again_after_an_edit() -> None:
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3))  # no ngram: prediction only
    pred = (10, 11, 12, 13, 14, 15, 16, 17)
    req = _req([1, 2], [10], prediction_token_ids=pred)
    assert drafter.drafts_for(req)
    assert drafter.propose(req, 8) == [11, 12, 13]
    req.output_token_ids += [11, 12]
    assert drafter.propose(req, 8) == [13, 14, 15]
    # The model wrote something else (an edit), then came back to the prediction's text.
    req.output_token_ids += [99]
    assert drafter.propose(req, 8) == []
    req.output_token_ids += [14, 15]
    assert drafter.propose(req, 8) == [16, 17]
    req.output_token_ids += [16, 17]
    assert drafter.propose(req, 8) == []  # the prediction is used up
    assert not drafter.drafts_for(_req([1], [2]))  # no prediction, no ngram: no drafts


def test_requests_whose_sampling_cannot_take_drafts_do_not_draft() -> None:
    drafter = Drafter(SpeculativeConfig("ngram"))
    assert not drafter.drafts_for(_req([1, 2, 1], [2], logits_processors=(lambda n, row: row,)))
    assert drafter.drafts_for(_req([1, 2, 1], [2], temperature=0.5, logit_bias={3: 1.0},
                                   presence_penalty=0.5, bad_words_token_ids=((1, 2),),
                                   logprobs=1))


def test_the_scheduler_feeds_drafts_within_max_tokens_and_the_token_budget() -> None:
    sched = make_scheduler("fcfs", block_size=4, num_blocks=64, max_num_batched_tokens=64)
    sched.use_drafter(Drafter(SpeculativeConfig(num_speculative_tokens=5)))
    pred = tuple(range(100, 120))
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=4, prediction_token_ids=pred), 0.0)
    sched.add_request(req, 0.0)
    plan = sched.schedule(0.0)  # the prefill samples the first token
    assert plan.scheduled[0].num_draft_tokens == 0
    sched.update(plan, ExecutorOutput([100], 0.01), 0.01)
    plan = sched.schedule(0.01)
    (s,) = plan.scheduled
    # 1 of max_tokens=4 is out: at most 3 more, so 2 drafts after the last token.
    assert (s.token_ids, s.start_pos, s.num_draft_tokens) == ([100, 101, 102], 3, 2)
    assert len(s.block_ids) * 4 >= s.num_context_tokens
    # The model kept one draft and chose its own next token.
    sched.update(plan, ExecutorOutput([101], 0.01, verified_token_ids={"a": [101, 55]}), 0.02)
    assert req.output_token_ids == [100, 101, 55]
    assert req.num_computed_tokens == 5  # the prompt, 100 and 101: 55's KV comes next step
    assert (req.num_draft_tokens, req.num_accepted_tokens) == (2, 1)
    plan = sched.schedule(0.02)
    (s,) = plan.scheduled
    assert s.num_draft_tokens == 0  # one token left: nothing to draft
    assert s.token_ids == [55] and s.start_pos == 5


def test_under_async_scheduling_only_a_useful_prediction_waits_for_its_token() -> None:
    drafter = Drafter(SpeculativeConfig())
    unrelated = _req([1, 2], [3], prediction_token_ids=(50, 51, 52))
    assert drafter.wants_last_token(unrelated)
    for t in range(4, 8):  # four steps find nothing to draft
        assert drafter.propose(unrelated, 5) == []
        unrelated.output_token_ids.append(t)
    assert not drafter.wants_last_token(unrelated)
    followed = _req([1, 2], [50], prediction_token_ids=(50, 51, 52))
    assert drafter.propose(followed, 5) == [51, 52]
    assert drafter.wants_last_token(followed)
    followed.output_token_ids += [51, 52]
    assert drafter.propose(followed, 5) == []  # used up: it goes ahead from now on
    assert not drafter.wants_last_token(followed)
    assert not drafter.wants_last_token(_req([1, 2], [3]))  # no prediction


def _drafts_under(cost: CostModel, verdicts: tuple[tuple[int, int], ...] = (),
                  fresh: bool = False) -> int:
    """Drafts planned for a request's decode (prediction long enough for 5) under `cost`,
    after `verdicts` ((drafted, kept) pairs) of its earlier verifications."""
    sched = make_scheduler("fcfs", block_size=4, num_blocks=64, cost=cost)
    sched.use_drafter(Drafter(SpeculativeConfig(num_speculative_tokens=5)))
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=50, prediction_token_ids=tuple(
        range(100, 140))), 0.0)
    sched.add_request(req, 0.0)
    plan = sched.schedule(0.0)
    sched.update(plan, ExecutorOutput([100], 0.01), 0.01)
    if not fresh:
        sched.drafting.drafter.propose(req, 0)  # a step that drafted nothing: the drafter knows it now
    for drafted, kept in verdicts:
        sched.drafting.drafter.observe("a", drafted, kept)
    (s,) = sched.schedule(0.01).scheduled
    return s.num_draft_tokens


def test_drafts_are_cut_to_what_the_cost_model_says_pays() -> None:
    # Weight-bound steps (a GPU, a small batch): a fed token costs little beside a step.
    cheap_tokens = CostModel(fixed_s=20e-3, per_prefill_token_s=0.2e-3, per_decode_s=0.5e-3)
    assert _drafts_under(cheap_tokens) == 5
    # Compute-bound steps: a fed token costs as much as a decode, and drafting never pays.
    assert _drafts_under(UNIT_COST) == 0
    # ... but its first decode, and one in PROBE_EVERY after, drafts a token to learn from.
    assert _drafts_under(UNIT_COST, fresh=True) == 1
    # In between, a request whose drafts were mostly rejected drafts fewer.
    middle = CostModel(fixed_s=2e-3, per_prefill_token_s=1e-3, per_decode_s=1e-3)
    good = _drafts_under(middle, ((5, 5),) * 4)
    poor = _drafts_under(middle, ((5, 0),) * 4)
    assert good == 5 and 0 <= poor < good
