"""vLLM's `priority` over every policy: a request with a lower value runs first, strictly,
preempting running ones between tokens; requests of one priority keep the policy's order."""

from __future__ import annotations

import dataclasses

import pytest

from fastserve.request import Request
from tests.core.factories import UNIT_COST, make_requests, make_scheduler, random_workload, serve
from tests.core.test_policies import CASE_IDS, CASES


def _with_priority(reqs: list[Request], priorities: list[int]) -> list[Request]:
    return [dataclasses.replace(r, priority=p) for r, p in zip(reqs, priorities, strict=True)]


@pytest.mark.parametrize(("policy", "config"), CASES, ids=CASE_IDS)
def test_a_lower_priority_runs_first_whatever_the_policy(policy: str, config: dict) -> None:
    # A long job runs; a short one of priority 1 arrives (every preemptive policy would run
    # it next), then a short one of priority -1 (which must take the device at once).
    long, later, urgent = _with_priority(
        make_requests([4, 4, 4], [40, 2, 2], arrivals=[0.0, 0.010, 0.020]), [0, 1, -1])
    sched = make_scheduler(policy, cost=UNIT_COST, max_batch_size=1, **config)
    run = serve(sched, [long, later, urgent])
    assert later.first_token_s is not None and long.finish_s is not None
    assert later.first_token_s > long.finish_s  # not a token before the long job finished
    assert sched.kv._kv.num_free_blocks == sched.kv._kv.num_total_blocks
    if policy == "request-level":  # static batching preempts nothing: priority forms batches
        assert [r.request_id for r in run.finished] == ["r0", "r2", "r1"]
        return
    assert [r.request_id for r in run.finished] == ["r2", "r0", "r1"]
    assert urgent.finish_s is not None and urgent.finish_s < 0.020 + 0.010  # 4 ms prefill, 1 decode
    assert long.num_preemptions == 1 and urgent.num_preemptions == 0


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "fcfs"])
def test_one_priority_for_all_keeps_the_policys_schedule(policy: str) -> None:
    prompts, outputs, arrivals = random_workload(40, seed=3)

    def trace(priority: int) -> list:
        reqs = _with_priority(make_requests(prompts, outputs, arrivals), [priority] * 40)
        return serve(make_scheduler(policy, cost=UNIT_COST, max_batch_size=4), reqs).trace()

    assert trace(7) == trace(0)
