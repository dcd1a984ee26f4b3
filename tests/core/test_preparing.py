"""A job waiting on its preparation (a grammar compiling beside the loop) prefills but does
not sample: it sits out at its last prompt token, KV kept, while the others get tokens, and
joins the batch once the engine takes it out of `Scheduler.preparing` (`prepared`)."""

from __future__ import annotations

from fastserve.clock import VirtualClock
from fastserve.engine.core import EngineCore
from fastserve.sim.executor import SimExecutor
from tests.core.factories import UNIT_COST, make_requests, make_scheduler


def test_a_preparing_job_prefills_then_waits_with_its_kv_while_others_run() -> None:
    sched = make_scheduler("skip-join-mlfq", cost=UNIT_COST)
    core = EngineCore(sched, SimExecutor(UNIT_COST), VirtualClock())
    slow, other = make_requests([40, 8], [5, 5])
    sched.add_request(slow, 0.0)
    sched.add_request(other, 0.0)
    sched.prepare(slow.request_id)
    for _ in range(4):
        core.step()
    assert slow.num_output_tokens == 0 and slow.num_computed_tokens == 39  # all but the last
    assert sched.kv._kv.has_blocks(slow.request_id)
    assert other.num_output_tokens == 4
    assert sched.num_preemptions == 0  # waiting on itself is not a preemption

    sched.prepared([slow.request_id])  # its grammar compiled
    core.step()
    assert slow.num_output_tokens == 1 and other.num_output_tokens == 5


def test_an_aborted_preparing_job_leaves_the_set() -> None:
    sched = make_scheduler("fcfs", cost=UNIT_COST)
    (req,) = make_requests([8], [4])
    sched.add_request(req, 0.0)
    sched.prepare(req.request_id)
    sched.abort(req.request_id, 0.0)
    assert not sched.preparing and not sched.has_unfinished
