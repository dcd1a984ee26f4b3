"""The scheduler's mechanism under every policy: the rules every KV move keeps, what scheduling
under memory pressure costs, and the narrow seam a KV policy works through (a fake stands in
for the scheduler there)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from fastserve.args import engine_config
from fastserve.bench.workloads import zipf_workload
from fastserve.clock import VirtualClock
from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import ReactivePolicy, RecomputePolicy, make_kv_policy
from fastserve.core.kv.manager import KVCacheManager
from fastserve.core.kv.moves import KVMoves
from fastserve.core.policies import make_scheduler
from fastserve.engine.core import EngineCore
from fastserve.request import Request, RequestStatus
from fastserve.sim.executor import SimExecutor
from fastserve.sim.simulator import make_requests as workload_requests
from tests.core.factories import (
    UNIT_COST,
    assert_all_done_and_free,
    kv_scheduler,
    make_requests,
    serve,
    serve_checked,
    tight_requests,
)


def test_no_job_is_offloaded_and_uploaded_in_one_iteration() -> None:
    for kv_policy in ("proactive", "reactive"):
        for variant in ("robust", "paper"):
            sched = kv_scheduler("skip-join-mlfq", kv_policy, mlfq_variant=variant,
                                 max_batch_size=6, max_num_batched_tokens=128)
            run = serve_checked(sched, tight_requests(seed=5))
            assert_all_done_and_free(run, 60)
            assert sched.stats().kv.num_offloads > 0
            for plan in run.plans:
                # A job moved both ways would have its host blocks written and read at once.
                assert not {h for _, h in plan.swap_out} & {h for h, _ in plan.swap_in}


def test_moving_a_job_back_in_the_same_iteration_is_refused() -> None:
    sched = kv_scheduler("fcfs", "reactive", num_blocks=8)
    [a] = make_requests([4], [8])
    sched.add_request(a, 0.0)
    core = EngineCore(sched, SimExecutor(UNIT_COST), VirtualClock())
    core.step()
    sched.schedule(0.01)  # a new iteration's bookkeeping starts
    assert sched.kv._moves.offload(a, release_now=False)
    with pytest.raises(ValueError, match="offloaded this iteration"):
        sched.kv._moves.upload(a)


@pytest.mark.parametrize(("kv_policy", "per_iteration"), [("reactive", 16), ("proactive", 4)])
def test_scheduling_under_pressure_does_not_rescan_the_queue(
    kv_policy: str, per_iteration: int
) -> None:
    """Under memory pressure most of a long queue is swapped jobs. Reactive: each tries to
    come back every iteration, and its victims must come from the few resident jobs, not a
    scan of the queue behind it (scheduling was O(queue x swapped jobs): 0.58 ms of a 4 ms
    real CPU iteration; ~250 victim checks per iteration then, ~3 now). Proactive: a swapped
    job the device is not to hold only waits, and the walk passes it without a look (looking
    cost 0.16 ms of a 3.7 ms iteration; ~29 deferrals asked per iteration then, ~1 now)."""
    cost = CostModel(fixed_s=1.2e-3, per_prefill_token_s=1e-4, per_decode_s=9e-5,
                     per_context_token_s=7e-7, kv_block_bytes=65536)
    config = engine_config(policy="skip-join-mlfq", kv_policy=kv_policy, max_batch_size=16,
                           num_host_blocks=50_000)
    kv = KVCacheManager(93, config.cache.block_size, 50_000)
    sched = make_scheduler(config.scheduler, kv, cost, kv_policy=make_kv_policy(config.cache))
    workload = zipf_workload(500, 30.0, 4.0, 1.2, 256, 1024, seed=0)
    run = serve(sched, workload_requests(workload))
    assert len(run.finished) == 500 and kv.num_swap_out_blocks > 1000  # heavy swapping
    ops = sched.kv._moves.num_victim_checks if kv_policy == "reactive" else sched.kv.num_defer_asks
    assert 0 < ops <= per_iteration * len(run.steps)


# -- the seam: a KV policy against a fake scheduler ---------------------------------------------


@dataclass
class FakeScheduler:
    """The few things a KV policy may ask (`SchedulerView`), over a real KV manager: the
    order and ENSTs are whatever the test says."""

    kv: KVCacheManager
    enst_s: dict[str, float]
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cost: CostModel = UNIT_COST
    moves: KVMoves = field(init=False)
    recomputed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.moves = KVMoves(self.kv, (), lambda r: self.recomputed.append(r.request_id))

    @property
    def order(self) -> Sequence[Request]:
        return []

    def resident(self) -> list[tuple[int, Request]]:
        return []

    def next_run_s(self, req: Request) -> float:
        return self.enst_s[req.request_id]

    def admit_tokens(self, req: Request) -> int:
        return req.num_tokens

    def level_of(self, request_id: str) -> int | None:
        return 0

    def num_in_top_queues(self, num_queues: int) -> int:
        return 0


def started(kv: KVCacheManager, prompt_lens: list[int]) -> list[Request]:
    reqs = make_requests(prompt_lens, [8] * len(prompt_lens))
    for r in reqs:
        assert kv.allocate(r.request_id, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
    return reqs


def test_a_policy_moves_the_latest_victim_through_the_seam() -> None:
    kv = KVCacheManager(num_device_blocks=8, block_size=4, num_host_blocks=8)
    a, b, c = started(kv, [4, 8, 4])
    sched = FakeScheduler(kv, {"r0": 0.1, "r1": 0.5, "r2": 0.3})
    assert ReactivePolicy().make_room(sched, c, [a, b], now=0.0)
    assert b.status is RequestStatus.SWAPPED and kv.is_swapped("r1")  # the largest ENST
    assert sched.moves.num_offloads == 1 and len(sched.moves.swap_out) == 2
    assert RecomputePolicy().make_room(sched, c, [a], now=0.0)
    assert sched.recomputed == ["r0"] and not kv.has_blocks("r0") and a.num_computed_tokens == 0
    assert not RecomputePolicy().make_room(sched, c, [], now=0.0)  # no victim: nothing moves
