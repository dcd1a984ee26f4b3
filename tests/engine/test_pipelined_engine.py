"""The pipelined step loop and the scheduler's in-flight hook (pipeline parallelism), on the
simulator's pipelined executor: no model, no processes."""

from __future__ import annotations

import dataclasses

from fastserve.clock import VirtualClock
from fastserve.core.plan import SchedulerOutput
from fastserve.core.scheduler import Scheduler
from fastserve.engine.core import PipelinedEngineCore
from fastserve.request import Request
from fastserve.sim.pipeline import PipelinedSimExecutor
from tests.core.factories import UNIT_COST, make_requests, make_scheduler

PP2 = dataclasses.replace(UNIT_COST, fixed_s=1e-3, pipeline_parallel_size=2, num_layers=2)


class CheckingExecutor(PipelinedSimExecutor):
    """Checks that no plan touches a job in flight: not batched again, and its KV blocks
    neither freed, moved nor handed to another job until its batch is back."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(PP2)
        self.scheduler = scheduler
        self.tables: dict[str, list[int]] = {}  # in-flight job -> its block table
        self.max_seen_in_flight = 0

    def submit(self, plan: SchedulerOutput, now: float) -> None:
        ids = {s.request_id for s in plan.scheduled}
        assert not ids & set(self.tables), "a job in flight was scheduled again"
        held = {b for t in self.tables.values() for b in t}
        assert not held & {d for d, _ in plan.swap_out}, "a job in flight was offloaded"
        assert not held & {b for s in plan.scheduled for b in s.block_ids}, "blocks reused"
        super().submit(plan, now)
        self.tables.update((s.request_id, list(s.block_ids)) for s in plan.scheduled)
        self.max_seen_in_flight = max(self.max_seen_in_flight, len(self._in_flight))


def _run(scheduler: Scheduler, requests: list[Request], max_in_flight: int = 2
         ) -> tuple[PipelinedEngineCore, CheckingExecutor]:
    executor = CheckingExecutor(scheduler)
    clock = VirtualClock()
    core = PipelinedEngineCore(scheduler, executor, clock, max_in_flight)
    for r in requests:
        scheduler.add_request(r, 0.0)
    for _ in range(10_000):
        if not scheduler.has_unfinished:
            return core, executor
        core.step()
        # Jobs still in flight kept their blocks (a recompute or swap would have dropped them).
        for rid in scheduler.in_flight:
            assert scheduler.kv.block_table(rid)[: len(executor.tables[rid])] == executor.tables[rid]
        for rid in list(executor.tables):
            if rid not in scheduler.in_flight:
                del executor.tables[rid]
    raise AssertionError("did not finish")


def test_next_batch_is_scheduled_while_the_first_is_in_flight() -> None:
    sched = make_scheduler("fcfs", max_batch_size=4)
    reqs = make_requests([5, 6, 7, 8], [3, 3, 3, 3])
    core = PipelinedEngineCore(sched, PipelinedSimExecutor(PP2), VirtualClock())
    for r in reqs:
        sched.add_request(r, 0.0)
    assert core.step() == [] and core.step() == []  # two launches, no token back yet
    assert core.num_in_flight == 2
    assert sched.in_flight == {r.request_id for r in reqs}  # each batch took half the jobs
    got = core.step()  # the pipeline is full: the oldest batch comes back
    assert sorted(r.request_id for r in got) == ["r0", "r1"]
    assert all(r.num_output_tokens == 1 for r in got)
    assert sched.in_flight == {"r2", "r3"}


def test_pipelined_run_keeps_jobs_in_flight_untouched_and_counts_no_preemption() -> None:
    sched = make_scheduler("fcfs", max_batch_size=8)
    reqs = make_requests([10 + i for i in range(8)], [6] * 8)
    core, executor = _run(sched, reqs)
    assert executor.max_seen_in_flight == 2
    assert all(r.num_output_tokens == 6 for r in reqs)
    assert sched.num_preemptions == 0  # being in flight is running, not preempted


def test_small_pool_never_takes_blocks_from_jobs_in_flight() -> None:
    for policy in ("skip-join-mlfq", "fcfs", "mlfq", "mlfq-preempt"):
        sched = make_scheduler(policy, num_blocks=12, block_size=4, max_batch_size=4)
        reqs = make_requests([9, 5, 13, 7, 11, 6], [8, 12, 5, 9, 7, 10])
        _run(sched, reqs)
        assert all(r.num_output_tokens == r.params.max_tokens for r in reqs), policy


def test_two_batches_in_flight_finish_in_about_half_the_time() -> None:
    times = {}
    for depth in (1, 2):
        sched = make_scheduler("fcfs", max_batch_size=4)
        core, _ = _run(sched, make_requests([4] * 8, [50] * 8), max_in_flight=depth)
        assert isinstance(core.clock, VirtualClock)
        times[depth] = core.clock.now()
    assert times[2] < 0.6 * times[1]
