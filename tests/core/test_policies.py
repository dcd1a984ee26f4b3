"""Every policy over the shared mechanism: limits, memory, determinism, what each may read.

Workloads run through `EngineCore` on a virtual clock with the simulator's executor; what is
checked is what a user would notice: every job finishes with all its tokens, no KV block leaks,
batches respect the configured limits, and only the oracle knows output lengths.
"""

from __future__ import annotations

import pytest

from fastserve.config import POLICIES, SchedulerConfig
from fastserve.core.kv import KVCacheManager, num_blocks_for
from fastserve.core.policies import POLICY_CLASSES
from fastserve.core.scheduler import Scheduler
from fastserve.core.scheduling_policy import SchedulingPolicy
from fastserve.request import FinishReason, Request, RequestStatus
from tests.core.factories import (
    UNIT_COST,
    Run,
    make_engine,
    make_requests,
    make_scheduler,
    random_workload,
    serve,
)

# Each policy, and the MLFQ ones in both variants.
CASES: list[tuple[str, dict[str, object]]] = [(p, {}) for p in POLICIES] + [
    (p, {"mlfq_variant": "paper"}) for p in ("skip-join-mlfq", "mlfq", "mlfq-preempt")
]
CASE_IDS = [p + ("-paper" if c else "") for p, c in CASES]
BLOCK_SIZE = 4
TIGHT_BLOCKS = 40  # the largest job (60 + 40 tokens) needs 25


def _tight_run(policy: str, config: dict, seed: int = 0, n: int = 60, budget: int = 128) -> Run:
    prompts, outputs, arrivals = random_workload(n, seed)
    sched = make_scheduler(policy, num_blocks=TIGHT_BLOCKS, block_size=BLOCK_SIZE,
                           max_batch_size=6, max_num_batched_tokens=budget, **config)
    return serve(sched, make_requests(prompts, outputs, arrivals))


def test_every_policy_in_the_config_is_registered() -> None:
    assert set(POLICY_CLASSES) == set(POLICIES)


@pytest.mark.parametrize(("policy", "config"), CASES, ids=CASE_IDS)
def test_every_policy_finishes_all_jobs_without_leaking_blocks(policy: str, config: dict) -> None:
    run = _tight_run(policy, config)
    sched = run.scheduler
    assert len(run.finished) == 60 and not sched.has_unfinished
    for req in run.finished:
        assert req.finish_reason is FinishReason.LENGTH
        assert req.num_output_tokens == req.params.max_tokens
        assert req.first_token_s is not None and req.finish_s is not None
    assert sched.kv._kv.num_free_blocks == sched.kv._kv.num_total_blocks


@pytest.mark.parametrize(("policy", "config"), CASES, ids=CASE_IDS)
def test_chunked_prefills_finish_every_job_without_leaking_blocks(policy: str,
                                                                  config: dict) -> None:
    """A 12-token budget under prompts of up to 60: most prefill in chunks, under the same
    memory pressure (preemption, offload, recompute between chunks)."""
    run = _tight_run(policy, config, seed=3, budget=12)
    assert len(run.finished) == 60
    for req in run.finished:
        assert req.num_output_tokens == req.params.max_tokens
    assert run.scheduler.kv._kv.num_free_blocks == run.scheduler.kv._kv.num_total_blocks
    assert any(not s.samples for p in run.plans for s in p.scheduled)  # chunks did run
    for plan in run.plans:  # one-token jobs always fit, as decodes do
        assert sum(len(s.token_ids) for s in plan.scheduled if len(s.token_ids) > 1) <= 12


@pytest.mark.parametrize(("policy", "config"), CASES, ids=CASE_IDS)
def test_batches_respect_batch_size_token_budget_and_kv_blocks(policy: str, config: dict) -> None:
    run = _tight_run(policy, config, seed=1)
    cfg = run.scheduler.config
    for plan, _ in run.steps:
        assert len(plan.scheduled) <= cfg.max_batch_size
        tokens = 0
        blocks: list[int] = []
        for s in plan.scheduled:
            tokens += len(s.token_ids)
            if len(s.token_ids) > 1:  # one token always fits; a prefill takes what is left
                assert tokens <= cfg.max_num_batched_tokens
            assert len(s.block_ids) >= num_blocks_for(s.num_context_tokens, BLOCK_SIZE)
            blocks += s.block_ids
        assert len(blocks) == len(set(blocks)) and len(blocks) <= TIGHT_BLOCKS


@pytest.mark.parametrize(("policy", "config"), CASES, ids=CASE_IDS)
def test_scheduling_is_deterministic(policy: str, config: dict) -> None:
    assert _tight_run(policy, config, seed=2).trace() == _tight_run(policy, config, seed=2).trace()


class SealedRequest(Request):
    """A request whose oracle length cannot be read: the test fails if a policy peeks."""

    @property  # type: ignore[override]
    def oracle_output_len(self) -> int | None:
        raise AssertionError("a policy other than srpt-oracle read oracle_output_len")

    @oracle_output_len.setter
    def oracle_output_len(self, value: int | None) -> None:
        pass


@pytest.mark.parametrize(("policy", "config"), [c for c in CASES if c[0] != "srpt-oracle"],
                         ids=[i for i in CASE_IDS if i != "srpt-oracle"])
def test_no_policy_but_the_oracle_reads_output_lengths(policy: str, config: dict) -> None:
    prompts, outputs, arrivals = random_workload(40, seed=3)

    def run(**kwargs: object) -> Run:
        sched = make_scheduler(policy, num_blocks=TIGHT_BLOCKS, block_size=BLOCK_SIZE,
                               max_batch_size=4, **config)
        return serve(sched, make_requests(prompts, outputs, arrivals, **kwargs))  # type: ignore[arg-type]

    sealed = run(request_cls=SealedRequest)
    assert len(sealed.finished) == 40
    lying = run(oracle_lens=[1000 - o for o in outputs])
    assert sealed.trace() == lying.trace() == run().trace()


def test_the_oracle_does_use_output_lengths() -> None:
    prompts, outputs, _ = random_workload(40, seed=3)

    def trace(oracle: list[int]) -> list:
        sched = make_scheduler("srpt-oracle", max_batch_size=4)
        return serve(sched, make_requests(prompts, outputs, oracle_lens=oracle)).trace()

    # (The oracle caps lengths at max_tokens, so the lie must be shorter than the truth.)
    assert trace(outputs) != trace([1] * len(outputs))


def test_srpt_oracle_runs_the_shortest_remaining_job_first() -> None:
    sched = make_scheduler("srpt-oracle", cost=UNIT_COST, max_batch_size=1)
    run = serve(sched, make_requests([5, 5, 5, 5], [30, 5, 12, 1]))
    assert [r.request_id for r in run.finished] == ["r3", "r1", "r2", "r0"]


def test_srpt_oracle_preempts_a_longer_job_for_a_shorter_arrival() -> None:
    sched = make_scheduler("srpt-oracle", cost=UNIT_COST, max_batch_size=1)
    # r0 has 50 tokens to go; r1 arrives 10 ms in needing a 5 ms prefill and 1 ms decode.
    long, short = make_requests([1, 5], [50, 2], arrivals=[0.0, 0.010])
    serve(sched, [long, short])
    assert short.finish_s is not None and long.finish_s is not None
    assert short.finish_s == pytest.approx(0.010 + 0.005 + 0.001, abs=1.01e-3)
    assert long.num_preemptions == 1 and short.finish_s < long.finish_s


def test_srpt_oracle_rejects_a_request_without_an_output_length() -> None:
    sched = make_scheduler("srpt-oracle")
    [req] = make_requests([3], [4], oracle_lens=[None])
    with pytest.raises(ValueError, match="oracle_output_len"):
        sched.add_request(req, 0.0)
    assert not sched.has_unfinished


def _first_plan_size(sched: Scheduler, reqs: list[Request]) -> int:
    for r in reqs:
        sched.add_request(r, 0.0)
    return len(sched.schedule(0.0).scheduled)


def test_orca_reserves_prompt_plus_max_tokens_and_admits_fewer_jobs() -> None:
    # 10 jobs of 16 + 64 tokens = 5 blocks each at most, in a 40-block pool.
    def jobs() -> list[Request]:
        return make_requests([16] * 10, [64] * 10)

    orca = make_scheduler("orca", num_blocks=40, block_size=16)
    fcfs = make_scheduler("fcfs", num_blocks=40, block_size=16)
    assert _first_plan_size(orca, jobs()) == 8
    assert _first_plan_size(fcfs, jobs()) == 10
    assert all(len(orca.kv.block_table(rid)) == 5 for rid in orca.requests if
               orca.kv._kv.has_blocks(rid))
    run = serve(make_scheduler("orca", num_blocks=40, block_size=16), jobs())
    assert run.scheduler.stats().kv.num_recomputes == 0 and len(run.finished) == 10


def test_fcfs_recomputes_when_blocks_run_out_and_every_job_still_finishes() -> None:
    sched = make_scheduler("fcfs", num_blocks=40, block_size=16)
    reqs = make_requests([16] * 10, [64] * 10)  # 50 blocks at the end: they cannot all fit
    for r in reqs:
        sched.add_request(r, 0.0)
    core, executor = make_engine(sched)
    victims: dict[str, int] = {}  # request id -> tokens generated when its KV was dropped
    while sched.has_unfinished:
        before = sched.stats().kv.num_recomputes
        core.step()
        if sched.stats().kv.num_recomputes > before:
            for r in reqs:
                if r.status is RequestStatus.WAITING and r.num_output_tokens > 0:
                    assert not sched.kv._kv.has_blocks(r.request_id)  # its KV was freed
                    assert r.num_computed_tokens == 0
                    victims.setdefault(r.request_id, r.num_output_tokens)
    assert victims
    # Each victim later prefills its prompt and the tokens it had generated, in one go.
    for rid, num_generated in victims.items():
        req = next(r for r in reqs if r.request_id == rid)
        refills = [s for plan, _ in executor.steps for s in plan.scheduled
                   if s.request_id == rid and s.start_pos == 0 and len(s.token_ids) > 16]
        assert refills and refills[0].token_ids[:16] == req.prompt_token_ids
        assert len(refills[0].token_ids) >= 16 + num_generated
    assert all(r.is_finished and r.num_output_tokens == 64 for r in reqs)
    assert sched.kv._kv.num_free_blocks == sched.kv._kv.num_total_blocks


def test_request_level_batch_admits_no_job_until_it_has_finished() -> None:
    sched = make_scheduler("request-level", cost=UNIT_COST, max_batch_size=4)
    # r0 and r1 form the batch at t=0 (r0 done at 6 ms); r2 arrives at 8 ms to a free slot.
    reqs = make_requests([1, 1, 1], [3, 20, 2], arrivals=[0.0, 0.0, 0.008])
    run = serve(sched, reqs)
    r0, r1, r2 = reqs
    assert r0.finish_s is not None and r1.finish_s is not None and r2.first_token_s is not None
    assert r0.finish_s < 0.008 < r1.finish_s <= r2.first_token_s - 0.001
    assert max(len(plan.scheduled) for plan, _ in run.steps) == 2


def test_request_level_forms_batches_in_arrival_order_up_to_the_batch_size() -> None:
    sched = make_scheduler("request-level", max_batch_size=2)
    run = serve(sched, make_requests([4, 4, 4, 4, 4], [2, 9, 1, 1, 1]))
    first_batch = {s.request_id for s in run.steps[0][0].scheduled}
    assert first_batch == {"r0", "r1"}
    assert [r.request_id for r in run.finished][2:] == ["r2", "r3", "r4"]


class NewestFirst(SchedulingPolicy):
    """A policy written outside the package: the latest arrival runs first."""

    def order(self, now: float) -> list[Request]:
        return list(reversed(self.requests.values()))


def test_a_policy_object_given_to_the_scheduler_decides_the_order() -> None:
    # No subclass of Scheduler: the policy is an object the one scheduler is given.
    config = SchedulerConfig(policy="fcfs", max_batch_size=1)
    sched = Scheduler(config, KVCacheManager(64, 16), UNIT_COST, NewestFirst(config, UNIT_COST))
    run = serve(sched, make_requests([4, 4, 4], [2, 2, 2]))
    assert [r.request_id for r in run.finished] == ["r2", "r1", "r0"]
    assert sched.level_of("r0") is None and sched.queue_lengths() == {1: 0}
    assert not any(issubclass(cls, Scheduler) for cls in POLICY_CLASSES.values())
