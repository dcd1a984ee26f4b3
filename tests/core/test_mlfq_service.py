"""Service follows the request: a beam search's steps and the later sequences of an `n` /
`best_of` request (`Request.service_of`) start at the request's MLFQ level with its attained
service, instead of skip-joining Q1 afresh.

Costs are `UNIT_COST` (1 ms per prefill token and per decode step) and quanta 2, 4, 8 ms, so a
job reaches the lowest level (Q4) after 14 ms of service.
"""

from __future__ import annotations

import pytest

from fastserve.core.plan import ExecutorOutput
from fastserve.core.policies.mlfq import MLFQBase
from fastserve.core.scheduler import Scheduler
from fastserve.request import Request
from tests.core.factories import UNIT_COST, make_requests, make_scheduler, serve


def mlfq(policy: str = "skip-join-mlfq") -> Scheduler:
    sched = make_scheduler(policy, cost=UNIT_COST, base_quantum_ms=2.0, mlfq_levels=4,
                           max_batch_size=1)
    assert isinstance(sched.policy, MLFQBase)
    return sched


def _finish_order(continues: bool, policy: str) -> list[str]:
    """r0 runs 40 tokens alone (a beam search's first steps, say); then r1 and r2 arrive
    together, 1-token prompts with 5 tokens to go, r1 first. r1 continues r0 when
    `continues`; r2 is a request of its own."""
    sched = mlfq(policy)
    (first,) = make_requests([1], [40])
    serve(sched, [first])
    step, fresh = make_requests([1, 1], [5, 5], prefix="s")
    if continues:
        step.service_of = first.request_id
    run = serve(sched, [step, fresh])
    return [r.request_id for r in run.finished]


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "mlfq"])
def test_a_later_step_of_a_served_request_yields_to_a_new_request(policy: str) -> None:
    # Continuing r0, s0 is at r0's lowest level: the new s1 runs first although it came later.
    assert _finish_order(True, policy) == ["s1", "s0"]


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "mlfq"])
def test_without_service_of_each_step_would_start_afresh_in_q1(policy: str) -> None:
    # The behaviour service_of exists to prevent: a step of a long request is as new as any.
    assert _finish_order(False, policy) == ["s0", "s1"]


def test_a_later_sequence_joins_its_first_sequence_level() -> None:
    # `n` = 2: sequence 0 has run down to the lowest level when sequence 1 is added.
    sched = mlfq()
    (seq0,) = make_requests([1], [100])
    sched.add_request(seq0, 0.0)
    now = 0.0
    while sched.level_of(seq0.request_id) != 3:
        plan = sched.schedule(now)
        now += 0.001
        sched.update(plan, ExecutorOutput([7] * len(plan.scheduled), 0.001), now)
    seq1 = Request(f"{seq0.request_id}#1", list(seq0.prompt_token_ids), seq0.params, 0.0,
                   service_of=seq0.request_id)
    other = Request("other", list(seq0.prompt_token_ids), seq0.params, 0.0)
    sched.add_request(seq1, now)
    sched.add_request(other, now)
    assert sched.level_of(seq1.request_id) == 3
    assert sched.level_of("other") == 0
