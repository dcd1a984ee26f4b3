"""`Scheduler.schedule_ahead` (async scheduling), step by step over ints: the batch on the
device counts as computed, its tokens are placeholders until `update`, and a job that stops
early leaves no placeholder behind."""

from __future__ import annotations

from fastserve.core.plan import PENDING_TOKEN, ExecutorOutput, SchedulerOutput
from fastserve.request import FinishReason, SamplingParams
from tests.core.factories import make_requests, make_scheduler

EOS = 2


def _out(plan: SchedulerOutput, tokens: dict[str, int]) -> ExecutorOutput:
    return ExecutorOutput([tokens[s.request_id] for s in plan.scheduled], duration_s=1e-3)


def test_the_next_plan_feeds_pending_tokens_and_update_puts_the_real_ones() -> None:
    sched = make_scheduler("fcfs", block_size=4, num_blocks=64)
    sched.eos_token_ids = frozenset({EOS})
    short, long, other = make_requests([5, 6, 7], [2, 8, 8])
    long.params = SamplingParams(max_tokens=8, temperature=0.0)  # stops at EOS
    for r in (short, long, other):
        sched.add_request(r, 0.0)
    free_at_start = sched.kv._kv.num_free_blocks

    prefills = sched.schedule(0.0)
    sched.schedule_ahead(prefills)
    # The short job's first token is its second-to-last: its decode may go ahead too.
    assert all(r.output_token_ids == [PENDING_TOKEN] for r in (short, long, other))
    assert (short.num_computed_tokens, long.num_computed_tokens) == (5, 6)
    decodes = sched.schedule(0.0)
    assert [(s.token_ids, s.start_pos, s.num_output_tokens) for s in decodes.scheduled] == [
        ([PENDING_TOKEN], 5, 1), ([PENDING_TOKEN], 6, 1), ([PENDING_TOKEN], 7, 1)]
    tokens = {"r0": 11, "r1": 12, "r2": 13}
    assert sched.update(prefills, _out(prefills, tokens), 0.0) == [short, long, other]
    assert [r.output_token_ids for r in (short, long, other)] == [[11], [12], [13]]
    assert short.num_computed_tokens == 5  # counted when scheduled ahead, not rolled back

    # The short job's token on the device is its last by length: it sits the next plan out.
    sched.schedule_ahead(decodes)
    assert short.output_token_ids == [11] and "r0" in sched.in_flight
    third = sched.schedule(0.0)
    assert [s.request_id for s in third.scheduled] == ["r1", "r2"]
    sched.update(decodes, _out(decodes, {"r0": 21, "r1": EOS, "r2": 23}), 0.0)
    sched.flight.back(decodes)  # the engine core's part: the plan is back
    assert short.finish_reason is FinishReason.LENGTH and short.output_token_ids == [11, 21]
    # The long job stopped at EOS while its next step was on the device: that step's token
    # is dropped when it comes back, and its blocks are already free.
    assert long.finish_reason is FinishReason.STOP and long.output_token_ids == [12, EOS]
    sched.schedule_ahead(third)
    assert long.output_token_ids == [12, EOS] and other.output_token_ids == [13, 23, PENDING_TOKEN]
    # A job ended with its token on the device (an abort, a failed launch) loses the placeholder.
    sched.abort("r2", 0.0)
    assert other.output_token_ids == [13, 23] and other.finish_reason is FinishReason.ABORT
    assert sched.update(third, _out(third, {"r1": 31, "r2": 33}), 0.0) == []
    assert not sched.flight.ahead and not sched.has_unfinished
    assert sched.kv._kv.num_free_blocks == free_at_start


def test_a_job_dropped_for_recompute_waits_for_its_token() -> None:
    """A job scheduled ahead whose KV is dropped is not prefilled again before its token is
    back (its tokens end in a placeholder), and then prefills all of them."""
    sched = make_scheduler("fcfs", block_size=4, num_blocks=64)
    (req,) = make_requests([6], [8])
    sched.add_request(req, 0.0)
    first = sched.schedule(0.0)
    sched.schedule_ahead(first)
    sched.kv._moves.recompute(req)
    assert sched.schedule(0.0).is_empty  # nothing to run until the token is read
    sched.update(first, _out(first, {"r0": 40}), 0.0)
    assert req.output_token_ids == [40] and req.num_computed_tokens == 0
    again = sched.schedule(0.0)
    assert [(s.token_ids, s.start_pos) for s in again.scheduled] == [
        (req.prompt_token_ids + [40], 0)]
