"""Robust skip-join MLFQ's FCFS deadline (`mlfq_fcfs_deadline`): a job whose expected finish,
were it to start only now, passes the given factor of its estimated FCFS time runs ahead of
every level. Lengths are never read: the estimate comes from the jobs finished so far.

Costs are `UNIT_COST` (1 ms per prefill token and per decode step), quanta 2, 4, 8 ms, two
batch slots and no oldest slots, so only the deadline can lift a job out of its level.
"""

from __future__ import annotations

import pytest

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.policies.fcfs_deadline import DEADLINE_MIN_SAMPLES, FCFSDeadlineEstimate
from fastserve.core.policies.mlfq import MLFQBase
from fastserve.core.policies.mlfq_settings import MLFQSettings
from tests.core.factories import UNIT_COST, make_requests, make_scheduler, serve

NUM_WARM = 20  # short jobs that finish first, so the length estimate exists
LONG = f"r{NUM_WARM}"


def _long_job_and_stream(factor: float, p99_factor: float = 0.0
                         ) -> tuple[dict[str, float], int]:
    """20 short jobs (3 tokens) arrive at once and finish; at 100 ms a long job (60 tokens)
    arrives to an idle engine and runs down to the lowest level; from 120 ms 40 more short
    jobs arrive faster than the two slots serve them. (Finish ms per job, jobs made urgent.)"""
    sched = make_scheduler("skip-join-mlfq", cost=UNIT_COST, base_quantum_ms=2.0,
                           mlfq_levels=4, max_batch_size=2, mlfq_oldest_slots=0,
                           mlfq_fcfs_deadline=factor, mlfq_fcfs_p99=p99_factor)
    policy = sched.policy
    assert isinstance(policy, MLFQBase)
    arrivals = [0.0] * NUM_WARM + [0.100] + [0.120 + 0.0015 * i for i in range(40)]
    reqs = make_requests([1] * 61, [3] * NUM_WARM + [60] + [3] * 40, arrivals)
    run = serve(sched, reqs)
    assert len(run.finished) == 61
    return {r.request_id: (r.finish_s or 0.0) * 1e3 for r in run.finished}, policy.num_urgent


def test_long_old_job_becomes_urgent_and_runs_ahead_of_a_stream_of_short_jobs() -> None:
    off, num_off = _long_job_and_stream(0)
    on, num_on = _long_job_and_stream(3.0)
    stream_off = max(v for k, v in off.items() if k != LONG)
    stream_on = max(v for k, v in on.items() if k != LONG)
    # Off: the long job waits in the lowest level until the stream has passed.
    assert num_off == 0
    assert off[LONG] > stream_off
    # On: every finished job had 3 tokens, so on an idle engine it was expected to end within
    # a few steps (its FCFS time); once its expected finish passes 3x that, it is urgent and
    # runs every iteration in a slot of its own (1 ms per step alone, 2 ms beside a short
    # job: at most 100 + 1 + 2 x 60 ms), ending before the stream, which it delays by at most
    # its own work.
    assert num_on >= 1
    assert on[LONG] <= 221 < off[LONG]
    assert on[LONG] < stream_on <= stream_off + 61


def test_the_estimated_fcfs_p99_bound_lifts_the_long_job_too() -> None:
    off, _ = _long_job_and_stream(0)
    on, num_on = _long_job_and_stream(0, p99_factor=1.0)
    # The warm-up's FCFS times (all 20 at once, two slots) end near 70-120 ms: once the long
    # job's expected finish passes that after its arrival, it runs every iteration.
    assert num_on >= 1
    assert on[LONG] <= 221 < off[LONG]
    assert on[LONG] < max(v for k, v in on.items() if k != LONG)


def test_a_factor_no_job_reaches_leaves_the_order_unchanged() -> None:
    off, _ = _long_job_and_stream(0)
    for loose, num_loose in (_long_job_and_stream(1e6), _long_job_and_stream(0, 1e6)):
        assert num_loose == 0
        assert loose == off


def test_residual_length_is_the_mean_excess_over_finished_lengths() -> None:
    est = FCFSDeadlineEstimate(UNIT_COST, 2)
    assert not est.is_ready
    lengths = [10] * (DEADLINE_MIN_SAMPLES - 4) + [100] * 4
    for req, n in zip(make_requests([1] * len(lengths), lengths), lengths, strict=True):
        req.output_token_ids = [1] * n  # finished
        est.add(req, None)
    assert est.is_ready
    mean = (10 * (DEADLINE_MIN_SAMPLES - 4) + 400) / DEADLINE_MIN_SAMPLES
    assert est.residual_tokens(0) == pytest.approx(mean)
    assert est.residual_tokens(10) == pytest.approx(90)  # only the 100s are longer
    assert est.residual_tokens(150) == 150  # past every finished job: as long again


def test_deadline_is_off_by_default_and_rejected_below_zero() -> None:
    assert MLFQSettings.from_config(SchedulerConfig(), CostModel()).fcfs_deadline == 0
    sched = make_scheduler("skip-join-mlfq")
    assert isinstance(sched.policy, MLFQBase) and sched.policy.num_urgent == 0
    assert MLFQSettings.from_config(SchedulerConfig(), CostModel()).fcfs_p99 == 0
    with pytest.raises(ValueError, match="mlfq_fcfs_deadline"):
        SchedulerConfig(mlfq_fcfs_deadline=-1)
    with pytest.raises(ValueError, match="mlfq_fcfs_p99"):
        SchedulerConfig(mlfq_fcfs_p99=-1)
