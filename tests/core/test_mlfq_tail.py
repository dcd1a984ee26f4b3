"""Robust skip-join MLFQ's tail bound: a job waiting to start in the lowest level is passed by
at most `mlfq_max_overtakes` later arrivals that started (see `MLFQSettings.max_overtakes`).

Costs are `UNIT_COST` (1 ms per prefill token and per decode step) and quanta 2, 4, 8 ms, so a
30-token prompt skip-joins the lowest level and a 1-token prompt reaches it, started, after
14 ms of service.
"""

from __future__ import annotations

import pytest

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.policies.mlfq import MLFQBase
from fastserve.core.policies.mlfq_settings import ROBUST_OVERTAKE_BATCHES, MLFQSettings
from fastserve.core.scheduler import Scheduler
from fastserve.request import Request
from tests.core.factories import UNIT_COST, make_requests, make_scheduler, serve


def mlfq(max_overtakes: int) -> Scheduler:
    sched = make_scheduler("skip-join-mlfq", cost=UNIT_COST, base_quantum_ms=2.0,
                           mlfq_levels=4, max_batch_size=1, mlfq_max_overtakes=max_overtakes)
    assert isinstance(sched.policy, MLFQBase)
    return sched


def _long_prompt_and_crowd() -> tuple[Request, list[Request]]:
    """`long` (a 30 ms prompt: the lowest level, unstarted) comes first; four 1-token prompts
    with 40-token outputs, behind it in arrival order, run down the upper levels first and
    reach the lowest level started."""
    long, *crowd = make_requests([30, 1, 1, 1, 1], [5, 40, 40, 40, 40])
    return long, crowd


def _finish_order(max_overtakes: int) -> list[str]:
    sched = mlfq(max_overtakes)
    long, crowd = _long_prompt_and_crowd()
    run = serve(sched, [long, *crowd])
    assert len(run.finished) == 5
    assert sched.level_of(long.request_id) is None
    return [r.request_id for r in run.finished]


def test_long_prompt_is_passed_by_at_most_max_overtakes_later_jobs() -> None:
    # Two overtakes allowed: the crowd's first two (r1, r2) may pass `long` (r0), the rest not.
    assert _finish_order(2) == ["r1", "r2", "r0", "r3", "r4"]


def test_without_a_bound_every_started_job_passes_the_long_prompt() -> None:
    # A bound above the crowd's size is the unbounded started-first rule that robust had
    # before: `long` waits for the whole crowd.
    assert _finish_order(10**6) == ["r1", "r2", "r3", "r4", "r0"]


def test_zero_overtakes_is_arrival_order_in_the_lowest_level() -> None:
    # The crowd still gets its 14 ms in the upper levels first, then `long`, which arrived
    # first, runs before any of them resumes.
    assert _finish_order(0) == ["r0", "r1", "r2", "r3", "r4"]


def test_bound_defaults_to_batches_for_robust_and_is_off_for_paper() -> None:
    cost = CostModel()
    robust = MLFQSettings.from_config(SchedulerConfig(max_batch_size=8), cost)
    assert robust.max_overtakes == ROBUST_OVERTAKE_BATCHES * 8
    set_ = MLFQSettings.from_config(SchedulerConfig(mlfq_max_overtakes=3), cost)
    assert set_.max_overtakes == 3
    paper = MLFQSettings.from_config(SchedulerConfig(mlfq_variant="paper"), cost)
    assert paper.max_overtakes == float("inf")


def test_negative_bound_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="mlfq_max_overtakes"):
        SchedulerConfig(mlfq_max_overtakes=-1)


def _long_job_finish_ms(oldest_slots: int) -> tuple[float, float]:
    """r0 (60 tokens) starts alone and runs down to the lowest level; then 40 short jobs
    arrive faster than the two slots can serve them. (r0's finish, the last short job's
    finish) in ms."""
    sched = make_scheduler("skip-join-mlfq", cost=UNIT_COST, base_quantum_ms=2.0,
                           mlfq_levels=4, max_batch_size=2, mlfq_oldest_slots=oldest_slots)
    arrivals = [0.0] + [0.020 + 0.0015 * i for i in range(40)]
    reqs = make_requests([1] * 41, [60] + [3] * 40, arrivals)
    run = serve(sched, reqs)
    finish = {r.request_id: (r.finish_s or 0.0) * 1e3 for r in run.finished}
    return finish["r0"], max(v for k, v in finish.items() if k != "r0")


def test_oldest_slot_keeps_an_old_long_job_running_through_a_stream_of_short_ones() -> None:
    starved, stream_done = _long_job_finish_ms(0)
    kept, stream_done_kept = _long_job_finish_ms(1)
    # Without the slot, r0 waits in the lowest level until the stream has passed.
    assert starved > stream_done
    # With it, r0 runs every iteration from its arrival: about its 60 steps, sharing each
    # iteration with a short job, and well before the stream ends; the stream is delayed
    # by at most r0's work.
    assert kept < 0.6 * starved and kept < stream_done_kept
    assert stream_done_kept <= stream_done + 61


def test_oldest_slots_default_to_a_quarter_of_the_batch_for_robust_only() -> None:
    cost = CostModel()
    assert MLFQSettings.from_config(SchedulerConfig(max_batch_size=16), cost).oldest_slots == 4
    assert MLFQSettings.from_config(
        SchedulerConfig(max_batch_size=16, mlfq_variant="paper"), cost).oldest_slots == 0
    with pytest.raises(ValueError, match="mlfq_oldest_slots"):
        SchedulerConfig(max_batch_size=4, mlfq_oldest_slots=5)


def _long_job_and_stream_ms(max_wait_steps: float) -> tuple[float, float, float]:
    """As above, without oldest slots: (r0's finish, the last short job's finish, the bound in
    ms: `max_wait_steps` full-batch decode iterations)."""
    sched = make_scheduler("skip-join-mlfq", cost=UNIT_COST, base_quantum_ms=2.0,
                           mlfq_levels=4, max_batch_size=2, mlfq_oldest_slots=0,
                           mlfq_max_wait_steps=max_wait_steps)
    policy = sched.policy
    assert isinstance(policy, MLFQBase)
    arrivals = [0.0] + [0.020 + 0.0015 * i for i in range(40)]
    reqs = make_requests([1] * 41, [60] + [3] * 40, arrivals)
    run = serve(sched, reqs)
    finish = {r.request_id: (r.finish_s or 0.0) * 1e3 for r in run.finished}
    return (finish["r0"], max(v for k, v in finish.items() if k != "r0"),
            policy.settings.max_wait_s * 1e3)


def test_wait_bound_lets_a_held_back_job_run_ahead_of_every_level() -> None:
    starved, stream_done, _ = _long_job_and_stream_ms(0)
    bounded, stream_done_bounded, bound_ms = _long_job_and_stream_ms(5)
    assert starved > stream_done  # off: r0 waits for the whole stream
    # On: once r0 has waited 5 iterations' worth in the lowest level it runs every iteration,
    # in a slot of its own, and ends well before the stream (which it delays by its work).
    assert 0 < bound_ms < 20
    assert bounded < 0.65 * starved and bounded < stream_done_bounded
    assert stream_done_bounded <= stream_done + 61


def test_wait_bound_is_off_by_default_and_rejected_below_zero() -> None:
    cost = CostModel()
    assert MLFQSettings.from_config(SchedulerConfig(), cost).max_wait_s == float("inf")
    set_ = MLFQSettings.from_config(SchedulerConfig(max_batch_size=4, mlfq_max_wait_steps=10),
                                    UNIT_COST)
    assert set_.max_wait_s == pytest.approx(10 * UNIT_COST.iteration_s(0, 4, 0))
    with pytest.raises(ValueError, match="mlfq_max_wait_steps"):
        SchedulerConfig(mlfq_max_wait_steps=-1)
