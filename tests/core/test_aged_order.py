"""The bounds on how long `srpt-oracle` and `gittins` let a job be passed (`age_weight`,
`urgent_after_s`): off they change nothing, on they move the order towards arrival order."""

from __future__ import annotations

import pytest

from fastserve.config import SchedulerConfig
from tests.core.factories import UNIT_COST, make_requests, make_scheduler, random_workload, serve


def _trace(policy: str, **config: float) -> list:
    prompts, outputs, arrivals = random_workload(60, seed=5, rate=400.0)
    sched = make_scheduler(policy, max_batch_size=4, **config)
    return serve(sched, make_requests(prompts, outputs, arrivals)).trace()


def test_a_large_age_weight_makes_the_oracle_serve_in_arrival_order() -> None:
    fcfs = _trace("fcfs")
    assert _trace("srpt-oracle", age_weight=1e6) == fcfs
    assert _trace("srpt-oracle", age_weight=0.0) != fcfs
    # A weight between the two is neither.
    middle = _trace("srpt-oracle", age_weight=0.5)
    assert middle != fcfs and middle != _trace("srpt-oracle")


def test_a_tiny_urgency_bound_makes_the_oracle_and_gittins_serve_in_arrival_order() -> None:
    fcfs = _trace("fcfs")
    assert _trace("srpt-oracle", urgent_after_s=1e-9) == fcfs
    assert _trace("gittins", urgent_after_s=1e-9) == fcfs


def _long_job_among_short_ones(policy: str, **config: float) -> float:
    """One 50-token job at t = 0 while 2-token jobs keep the one slot busy for 0.2 s:
    the long job's JCT."""
    n = 100
    reqs = make_requests([1] * (n + 1), [50] + [2] * n, [0.0] + [0.001 + 0.002 * i for i in range(n)])
    sched = make_scheduler(policy, cost=UNIT_COST, max_batch_size=1, **config)
    run = serve(sched, reqs)
    long = next(r for r in run.finished if r.request_id == "r0")
    assert long.finish_s is not None
    return long.finish_s - long.arrival_s


def test_an_urgent_job_is_no_longer_passed() -> None:
    # SRPT passes the long job until the short ones stop coming (0.2 s); with the bound it is
    # urgent once its age plus its 50 ms alone reach 80 ms, and runs to the end from there.
    assert _long_job_among_short_ones("srpt-oracle") > 0.2
    assert _long_job_among_short_ones("srpt-oracle", urgent_after_s=0.08) == pytest.approx(
        0.08, abs=0.003)


def test_the_bounds_refuse_negative_values() -> None:
    with pytest.raises(ValueError, match="age_weight"):
        SchedulerConfig(age_weight=-1.0)
    with pytest.raises(ValueError, match="urgent_after_s"):
        SchedulerConfig(urgent_after_s=-1.0)
