"""`gittins`: ranks learned from finished jobs' lengths; arrival order until there are enough;
the overtaking bound. Runs through the real scheduler on a virtual clock (batch 1, 1 ms per
token) so that who preempts whom is what a user would see in the finish times."""

from __future__ import annotations

import pytest

from fastserve.core.policies.gittins import MIN_SAMPLES, LengthModel, age_grid
from fastserve.request import Request
from tests.core.factories import UNIT_COST, make_requests, make_scheduler, serve

HEAVY_TAIL = ([2] * 9 + [300]) * 4  # most jobs end at once, a few run long
ALIKE = [100] * 40


def test_age_grid_is_dense_then_geometric() -> None:
    grid = age_grid(2048)
    assert grid[:17] == list(range(17)) and grid[-1] == 2048
    assert all(b > a for a, b in zip(grid, grid[1:], strict=False))
    assert len(grid) < 60
    assert age_grid(3) == [0, 1, 2, 3]


def test_ranks_follow_the_hazard_of_the_learned_lengths() -> None:
    step = 1e-3
    heavy = LengthModel(HEAVY_TAIL, step)
    # Decreasing hazard: a job that outlived the short ones is probably a long one.
    assert heavy.rank(0, step) < heavy.rank(10)
    alike = LengthModel(ALIKE, step)
    # Increasing hazard: the older a job, the sooner it ends.
    assert alike.rank(50) < alike.rank(10) < alike.rank(0, step)
    for age in alike.grid[1:-1]:  # on the grid, exactly its remaining tokens
        assert alike.rank(age) == pytest.approx((100 - age) * step)
    # A job older than every observed length keeps the oldest observed age's rank.
    assert alike.rank(5000) == alike.rank(99)
    with pytest.raises(ValueError, match="at least one"):
        LengthModel([], step)


def _history_then(outputs: list[int], probe: list[tuple[float, int]], **config: object
                  ) -> tuple[list[Request], list[Request]]:
    """Serve `outputs` (all at t=0), then the probe jobs (arrival s, output length)."""
    history = make_requests([1] * len(outputs), outputs, [0.0] * len(outputs), prefix="h")
    probes = make_requests([1] * len(probe), [o for _, o in probe], [t for t, _ in probe],
                           prefix="p")
    sched = make_scheduler("gittins", cost=UNIT_COST, max_batch_size=1, **config)
    run = serve(sched, history + probes)
    assert len(run.finished) == len(history) + len(probes)
    return history, probes


def test_arrival_order_until_enough_lengths_are_known() -> None:
    history, _ = _history_then([5, 1, 9, 2, 7, 1, 3, 8] * 3, [])
    assert len(history) < MIN_SAMPLES
    finish = [r.finish_s for r in history]
    assert finish == sorted(finish)  # first come, first served; nobody preempted
    assert all(r.num_preemptions == 0 for r in history)


def test_heavy_tail_learned_a_new_job_preempts_an_old_one() -> None:
    # The history ends by t = 1.6 s; the long probe has run 100 tokens when the short arrives.
    _, (long, short) = _history_then(HEAVY_TAIL, [(2.0, 300), (2.101, 2)])
    assert long.num_preemptions == 1
    assert short.finish_s is not None and long.finish_s is not None
    assert short.finish_s < 2.11 < long.finish_s


def test_alike_lengths_learned_the_running_job_finishes_first() -> None:
    # Every job has taken 100 tokens: at age 50 the running job is the closer to done.
    _, (first, second) = _history_then(ALIKE, [(5.0, 100), (5.051, 100)])
    assert first.num_preemptions == 0
    assert first.finish_s is not None and second.finish_s is not None
    assert first.finish_s < second.finish_s


@pytest.mark.parametrize("bound", [None, 3])
def test_overtaking_bound(bound: int | None) -> None:
    """At most `bound` later arrivals finish before a job; unbounded, every short one does."""
    probe = [(2.0, 300)] + [(2.1 + 0.01 * i, 2) for i in range(10)]
    config = {} if bound is None else {"mlfq_max_overtakes": bound}
    _, (long, *shorts) = _history_then(HEAVY_TAIL, probe, **config)
    assert long.finish_s is not None
    passed = sum(1 for s in shorts if s.finish_s is not None and s.finish_s < long.finish_s)
    assert passed == (10 if bound is None else bound)


def test_a_bound_of_zero_is_first_come_first_served() -> None:
    probe = [(2.0, 300)] + [(2.1 + 0.01 * i, 2) for i in range(5)]
    _, probes = _history_then(HEAVY_TAIL, probe, mlfq_max_overtakes=0)
    finish = [r.finish_s for r in probes]
    assert finish == sorted(finish) and all(r.num_preemptions == 0 for r in probes)
