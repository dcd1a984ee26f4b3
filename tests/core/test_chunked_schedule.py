"""Chunked prefill in the scheduler: a prompt over the token budget runs in chunks beside the
decodes, is charged chunk by chunk and is preempted between chunks."""

from __future__ import annotations

import pytest

from fastserve.core.policies.mlfq import MLFQBase
from fastserve.core.scheduler import Scheduler
from tests.core.factories import UNIT_COST, make_engine, make_requests, make_scheduler


def _mlfq(**config: object) -> Scheduler:
    config.setdefault("base_quantum_ms", 2.0)  # quanta 2, 4, 8, 16 ms
    sched = make_scheduler("skip-join-mlfq", cost=UNIT_COST, **config)  # type: ignore[arg-type]
    assert isinstance(sched.policy, MLFQBase)
    return sched


def test_long_prompt_prefills_in_budget_sized_chunks_and_samples_once() -> None:
    sched = _mlfq(max_num_batched_tokens=16)
    [req] = make_requests([50], [3])
    sched.add_request(req, 0.0)
    core, ex = make_engine(sched)
    while sched.has_unfinished:
        core.step()
    trace = [(s.start_pos, len(s.token_ids), s.samples) for p, _ in ex.steps for s in p.scheduled]
    assert trace == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True),
                     (50, 1, True), (51, 1, True)]
    assert req.output_token_ids and len(req.output_token_ids) == 3
    # Blocks came chunk by chunk, not all at the first one.
    assert [len(p.scheduled[0].block_ids) for p, _ in ex.steps[:4]] == [1, 2, 3, 4]


def test_chunks_are_charged_and_a_short_arrival_preempts_between_chunks() -> None:
    sched = _mlfq(max_num_batched_tokens=4, max_batch_size=1)
    [long_req] = make_requests([40], [2], prefix="long")
    sched.add_request(long_req, 0.0)
    core, ex = make_engine(sched)
    # Skip-join: 10 chunks of 4 ms each (40 ms of prefill) place it in the lowest level.
    assert sched.level_of(long_req.request_id) == 3
    core.step()
    core.step()
    assert long_req.num_computed_tokens == 8
    assert isinstance(sched.policy, MLFQBase)
    assert sched.policy._jobs[long_req.request_id].attained_s == 8e-3  # charged for its two chunks
    [short] = make_requests([2], [1], prefix="short")
    sched.add_request(short, core.clock.now())
    assert sched.level_of(short.request_id) == 0
    plan = sched.schedule(core.clock.now())
    # The short job runs next; the long prefill waits between chunks with its KV kept.
    assert [s.request_id for s in plan.scheduled] == ["short0"]
    assert plan.preempted_ids == ["long0"]
    assert sched.kv._kv.has_blocks(long_req.request_id)


@pytest.mark.parametrize("pairs_s,context_s", [(1e-6, 0.0), (1e-6, 5e-6), (0.0, 5e-6)],
                         ids=["pairs", "pairs+context", "context"])
def test_late_chunks_shrink_so_an_iteration_costs_no_more_than_the_budget(
    pairs_s: float, context_s: float,
) -> None:
    """Whether a late chunk is dearer per token (attention pairs) or per chunk (reading the
    cached context), the scheduler sizes it so its iteration costs no more than the first."""
    from fastserve.core.cost_model import CostModel

    cost = CostModel(fixed_s=0.0, per_prefill_token_s=1e-4, per_prefill_token2_s=pairs_s,
                     per_prefill_context_token_s=context_s)
    sched = make_scheduler("fcfs", cost=cost, max_num_batched_tokens=100)
    [req] = make_requests([1000], [1])
    sched.add_request(req, 0.0)
    core, ex = make_engine(sched)
    while sched.has_unfinished:
        core.step()
    chunks = [(s.start_pos, len(s.token_ids)) for p, _ in ex.steps for s in p.scheduled]
    assert chunks[0] == (0, 100) and sum(n for _, n in chunks) == 1000
    assert chunks[-1][1] < chunks[1][1] < 100  # each later chunk attends over more
    budget_s = cost.prefill_s(100)
    assert all(cost.prefill_s(n, start) <= budget_s * (1 + 1e-9) for start, n in chunks)
