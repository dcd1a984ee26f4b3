"""MLFQ family: skip-join placement, demotion, starvation promotion, the variants, abandonment.

Costs are `UNIT_COST` (no fixed cost, 1 ms per prefill token and per decode step) so that a
job's charge is easy to follow: a lone job is charged exactly the iteration's duration under
either charge rule.
"""

from __future__ import annotations

import itertools
import math

import pytest

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv.manager import KVCacheManager
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.core.policies import make_scheduler as build_scheduler
from fastserve.core.policies.mlfq import (
    MLFQBase,
    MLFQPreemptPolicy,
    SkipJoinMLFQPolicy,
)
from fastserve.core.policies.mlfq_settings import (
    PAPER_LONGEST_JOB_STEPS,
    PAPER_STARVE_LIMIT_S,
    ROBUST_QUANTUM_STEPS,
    ChargeModel,
    MLFQSettings,
)
from fastserve.core.scheduler import Scheduler
from fastserve.request import SamplingParams
from tests.core.factories import UNIT_COST, make_engine, make_requests, make_scheduler, serve


def mlfq(policy: str = "skip-join-mlfq", **config: object) -> Scheduler:
    config.setdefault("base_quantum_ms", 2.0)  # quanta 2, 4, 8, 16 ms
    sched = make_scheduler(policy, cost=UNIT_COST, **config)  # type: ignore[arg-type]
    assert isinstance(sched.policy, MLFQBase)
    return sched


def policy_of(sched: Scheduler) -> MLFQBase:
    """The scheduler's MLFQ policy, whose counters and settings the tests read."""
    assert isinstance(sched.policy, MLFQBase)
    return sched.policy


def test_default_policy_is_skip_join_mlfq() -> None:
    config = SchedulerConfig()
    assert config.policy == "skip-join-mlfq"
    sched = build_scheduler(config, KVCacheManager(64, 16), CostModel())
    assert isinstance(sched.policy, SkipJoinMLFQPolicy)


def test_skip_join_places_long_prompts_in_lower_levels() -> None:
    sched = mlfq()
    # Prefill times 1, 3, 6, 12, 30, 500 ms against quanta 2, 4, 8, (16) ms.
    reqs = make_requests([1, 3, 6, 12, 30, 500], [4] * 6)
    for r in reqs:
        sched.add_request(r, 0.0)
    assert [sched.level_of(r.request_id) for r in reqs] == [0, 1, 2, 3, 3, 3]


def test_queue_lengths_count_the_jobs_in_each_level_as_they_move_and_leave() -> None:
    """What `/metrics` reports as `fastserve_queue_length{level=...}`."""
    sched = mlfq()
    reqs = make_requests([1, 3, 6, 12, 30, 500], [4] * 6)
    for r in reqs:
        sched.add_request(r, 0.0)
    assert sched.queue_lengths() == {1: 1, 2: 1, 3: 1, 4: 3}
    assert sched.num_in_top_queues(2) == 2
    [lone] = make_requests([1], [30])
    other = mlfq()
    other.add_request(lone, 0.0)
    core, _ = make_engine(other)
    for _ in range(3):  # 3 ms of service: past Q1's 2 ms quantum
        core.step()
    assert other.queue_lengths() == {1: 0, 2: 1, 3: 0, 4: 0}
    sched.abort(reqs[5].request_id, 0.0)
    sched.abort(reqs[0].request_id, 0.0)
    assert sched.queue_lengths() == {1: 0, 2: 1, 3: 1, 4: 2}


def test_skip_join_runs_the_short_prompt_first_even_if_it_came_last() -> None:
    sched = mlfq(max_batch_size=1)
    reqs = make_requests([400, 200, 2], [3, 3, 3])
    for r in reqs:
        sched.add_request(r, 0.0)
    assert [s.request_id for s in sched.schedule(0.0).scheduled] == ["r2"]


@pytest.mark.parametrize("policy", ["mlfq", "mlfq-keep-batch", "mlfq-preempt"])
def test_plain_mlfq_puts_every_job_in_q1(policy: str) -> None:
    sched = mlfq(policy)
    reqs = make_requests([1, 30, 500], [4] * 3)
    for r in reqs:
        sched.add_request(r, 0.0)
    assert [sched.level_of(r.request_id) for r in reqs] == [0, 0, 0]


def test_job_is_demoted_after_using_up_each_quantum() -> None:
    sched = mlfq()
    [req] = make_requests([1], [30])
    sched.add_request(req, 0.0)
    core, _ = make_engine(sched)
    levels = []
    for _ in range(20):
        core.step()  # every iteration of a lone job costs 1 ms
        levels.append(sched.level_of(req.request_id))
    # 2 ms in Q1, 4 ms in Q2, 8 ms in Q3, then the lowest level for good.
    assert levels == [0] + [1] * 4 + [2] * 8 + [3] * 7
    assert policy_of(sched).num_demotions == 3


@pytest.mark.parametrize("charge", ["iteration", "own"])
def test_demotion_target_is_chosen_from_the_next_iteration(charge: str) -> None:
    # A long context makes each decode step cost 10+ ms: past Q2 (4 ms) and Q3 (8 ms).
    cost = CostModel(fixed_s=0.0, per_prefill_token_s=1e-5, per_decode_s=0.0,
                     per_context_token_s=1e-4)
    sched = make_scheduler("skip-join-mlfq", cost=cost, base_quantum_ms=2.0, mlfq_levels=5,
                           mlfq_charge=charge)
    assert isinstance(sched.policy, MLFQBase)
    [req] = make_requests([100], [10])
    sched.add_request(req, 0.0)
    assert sched.level_of(req.request_id) == 0  # a 1 ms prefill fits Q1
    core, _ = make_engine(sched)
    core.step()  # the prefill: 1 ms attained of 2
    assert sched.level_of(req.request_id) == 0
    core.step()  # a 10.1 ms decode uses up Q1; the next one (10.2 ms) fits Q4's 16 ms
    assert sched.level_of(req.request_id) == 3


def _starvation_setup(starve_limit_s: float) -> tuple[Scheduler, list]:
    sched = mlfq(max_batch_size=1, starve_limit_s=starve_limit_s)
    # A 50 ms prompt (lowest level), then a crowd of 1 ms jobs that keep Q1 busy for 200 ms.
    return sched, make_requests([50] + [1] * 200, [10] + [1] * 200, prefix="j")


def test_starving_job_is_promoted_to_q1_with_an_extra_quantum() -> None:
    sched, reqs = _starvation_setup(starve_limit_s=0.02)
    for r in reqs:
        sched.add_request(r, 0.0)
    long = reqs[0]
    assert sched.level_of(long.request_id) == 3
    core, _ = make_engine(sched)
    while long.first_token_s is None:
        core.step()
    # Promoted after ~20 ms of waiting and run ahead of the short jobs still queued.
    assert policy_of(sched).num_promotions == 1
    assert long.first_token_s == pytest.approx(0.020 + 0.050, abs=1.01e-3)
    assert sum(not r.is_finished for r in reqs[1:]) > 100
    # The 50 ms prefill overran Q1's 2 ms, but the extra quantum (50 ms) kept it in Q1...
    assert sched.level_of(long.request_id) == 0
    core.step()
    core.step()
    # ...for its quantum plus that extra: 50 + 1 + 1 = 52 ms attained, then demoted.
    assert sched.level_of(long.request_id) != 0


def test_without_starvation_promotion_the_long_job_waits_for_all_short_ones() -> None:
    sched, reqs = _starvation_setup(starve_limit_s=0.0)
    run = serve(sched, reqs)
    assert run.finished[-1].request_id == "j0"
    assert policy_of(sched).num_promotions == 0


def _switches(run_steps: list, ids: set[str]) -> int:
    order = [s.request_id for plan, _ in run_steps for s in plan.scheduled if s.request_id in ids]
    return sum(a != b for a, b in itertools.pairwise(order))


def test_paper_variant_time_shares_one_level_and_robust_does_not() -> None:
    switches = {}
    for variant in ("paper", "robust"):
        sched = mlfq(max_batch_size=1, mlfq_variant=variant, mlfq_levels=4)
        run = serve(sched, make_requests([1, 1], [60, 60]))
        assert len(run.finished) == 2
        switches[variant] = _switches(run.steps, {"r0", "r1"})
    # robust: the two take turns only while passing through the three upper levels (6
    # switches), then the first finishes before the second resumes.
    assert switches["robust"] == 7
    # paper: equal jobs of one level alternate every iteration.
    assert switches["paper"] >= 50


@pytest.mark.parametrize("variant", ["robust", "paper"])
def test_started_job_keeps_its_place_in_the_lowest_level_only_when_robust(variant: str) -> None:
    sched = mlfq(max_batch_size=1, mlfq_variant=variant, mlfq_levels=4)
    # `long` skip-joins the lowest level; `short` arrives later, starts in Q1 and reaches the
    # lowest level after 14 ms of service, still owing 16 tokens.
    long, short = make_requests([30, 1], [5, 30])
    run = serve(sched, [long, short])
    assert len(run.finished) == 2
    assert long.first_token_s is not None and short.finish_s is not None
    if variant == "robust":  # started beats unstarted: `short` is never preempted by `long`
        assert short.finish_s < long.first_token_s and short.num_preemptions == 0
    else:  # the earlier, unserved `long` goes first in the paper's turn-taking
        assert long.first_token_s < short.finish_s and short.num_preemptions > 0


def test_settings_follow_the_variant_unless_set() -> None:
    cost = CostModel()
    robust = MLFQSettings.from_config(SchedulerConfig(), cost)
    assert (robust.charge, robust.shallow_levels, robust.num_levels, robust.starve_limit_s) == (
        "own", 4, 6, 0.0)
    assert robust.is_arrival_order
    step = ChargeModel(cost, "own", 16).step_s
    assert robust.quanta_s[0] == pytest.approx(ROBUST_QUANTUM_STEPS * step)
    assert robust.quanta_s[3] == pytest.approx(8 * ROBUST_QUANTUM_STEPS * step)

    paper = MLFQSettings.from_config(SchedulerConfig(mlfq_variant="paper"), cost)
    assert paper.charge == "iteration" and not paper.is_arrival_order
    assert paper.starve_limit_s == PAPER_STARVE_LIMIT_S
    assert paper.quanta_s[0] == pytest.approx(cost.iteration_s(0, 16, 0))
    assert paper.quanta_s[-1] >= PAPER_LONGEST_JOB_STEPS * paper.quanta_s[0] > paper.quanta_s[-2]

    set_ = MLFQSettings.from_config(
        SchedulerConfig(mlfq_variant="paper", mlfq_levels=3, mlfq_charge="own",
                        starve_limit_s=0.0, base_quantum_ms=5.0, quantum_ratio=3.0),
        cost,
    )
    assert set_.charge == "own" and set_.starve_limit_s == 0.0
    assert set_.quanta_s == pytest.approx((0.005, 0.015, 0.045))


@pytest.mark.parametrize("bad", [{"mlfq_levels": 0}, {"mlfq_charge": "mine"},
                                 {"starve_limit_s": -1.0}, {"quantum_decode_steps": 0.0}])
def test_bad_mlfq_knobs_are_rejected_by_name(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SchedulerConfig(**bad)


def _sched(rid: str, start: int, n: int) -> ScheduledRequest:
    return ScheduledRequest(rid, [1] * n, start, [], SamplingParams(), 0)


def test_own_charges_split_the_measured_duration_by_cost_model_shares() -> None:
    cost = CostModel(fixed_s=2e-3, per_prefill_token_s=1e-4, per_decode_s=3e-4,
                     per_context_token_s=1e-6)
    plan = SchedulerOutput([_sched("p", 0, 100), _sched("d", 99, 1), _sched("e", 999, 1)])
    own = ChargeModel(cost, "own", 16).charges(plan, duration_s=0.03)
    assert sum(own) == pytest.approx(0.03)
    # Shares before scaling: 2/3 ms of fixed cost each, plus 10 ms, 0.4 ms and 1.3 ms.
    shares = [2e-3 / 3 + 1e-2, 2e-3 / 3 + 4e-4, 2e-3 / 3 + 1.3e-3]
    assert own == pytest.approx([s * 0.03 / sum(shares) for s in shares])
    assert ChargeModel(cost, "iteration", 16).charges(plan, 0.03) == [0.03] * 3


def test_mlfq_keep_batch_keeps_running_jobs_in_the_batch() -> None:
    for policy, is_preempted in (("mlfq-keep-batch", False), ("mlfq", True),
                                 ("skip-join-mlfq", True)):
        sched = mlfq(policy, max_batch_size=2)
        first = make_requests([1, 1], [40, 40], prefix="a")
        for r in first:
            sched.add_request(r, 0.0)
        core, _ = make_engine(sched)
        for _ in range(10):  # both are demoted below Q1 by now
            core.step()
        [new] = make_requests([1], [5], prefix="n")
        sched.add_request(new, core.clock.now())
        plan = sched.schedule(core.clock.now())
        ids = {s.request_id for s in plan.scheduled}
        assert ("n0" in ids) is is_preempted, policy
        assert (plan.preempted_ids != []) is is_preempted, policy


def test_mlfq_preempt_abandons_an_iteration_that_overruns_the_quantum() -> None:
    sched = mlfq("mlfq-preempt")
    assert isinstance(sched.policy, MLFQPreemptPolicy)
    [req] = make_requests([10], [3])  # a 10 ms prefill against Q1's 2 ms
    sched.add_request(req, 0.0)
    core, executor = make_engine(sched)
    core.step()
    # Run and paid for, but its token dropped; demoted to the level that fits 10 ms (Q4).
    assert core.clock.now() == pytest.approx(0.010)
    assert req.output_token_ids == [] and req.num_computed_tokens == 0
    assert not sched.kv._kv.has_blocks(req.request_id)  # an abandoned prefill keeps no blocks
    assert sched.level_of(req.request_id) == 3 and policy_of(sched).num_abandoned == 1
    core.step()  # the same prefill again, kept this time
    assert executor.steps[1][0].scheduled[0].start_pos == 0
    assert req.num_output_tokens == 1 and req.num_computed_tokens == 10
    while not req.is_finished:
        core.step()
    assert req.num_output_tokens == 3 and policy_of(sched).num_abandoned == 1
    assert sched.kv._kv.num_free_blocks == sched.kv._kv.num_total_blocks
    assert req.first_token_s == pytest.approx(0.020)


def test_quantum_is_derived_from_the_cost_model_when_not_set() -> None:
    sched = make_scheduler("skip-join-mlfq", cost=CostModel(), quantum_decode_steps=3.0)
    assert isinstance(sched.policy, MLFQBase)
    step = ChargeModel(CostModel(), "own", sched.config.max_batch_size).step_s
    assert policy_of(sched).settings.quanta_s[0] == pytest.approx(3 * step)
    assert math.isclose(policy_of(sched).settings.quanta_s[1], 2 * policy_of(sched).settings.quanta_s[0])


def test_recalibrated_cost_model_keeps_derived_quanta_in_decode_steps() -> None:
    # The engine found its iterations taking 1.5x the profile: placements and quanta follow,
    # so a quantum still holds as many decode steps and a prompt still joins the same level.
    sched = make_scheduler("skip-join-mlfq", cost=CostModel(), quantum_decode_steps=3.0)
    assert isinstance(sched.policy, MLFQBase)
    before = policy_of(sched).settings.quanta_s
    [long] = make_requests([2000], [4])
    level = policy_of(sched).charge.prefill_s(2000)
    sched.recalibrate(CostModel().scaled(1.5))
    assert sched.cost == CostModel().scaled(1.5) and policy_of(sched).charge.cost is sched.cost
    assert policy_of(sched).settings.quanta_s == pytest.approx([1.5 * q for q in before])
    assert policy_of(sched).charge.prefill_s(2000) == pytest.approx(1.5 * level)
    sched.add_request(long, 0.0)
    fresh = make_scheduler("skip-join-mlfq", cost=CostModel(), quantum_decode_steps=3.0)
    [same] = make_requests([2000], [4])
    fresh.add_request(same, 0.0)
    assert sched.level_of(long.request_id) == fresh.level_of(same.request_id) > 0
    # A quantum set in milliseconds is the user's: it stays.
    fixed = make_scheduler("skip-join-mlfq", cost=CostModel(), base_quantum_ms=4.0)
    assert isinstance(fixed.policy, MLFQBase)
    fixed.recalibrate(CostModel().scaled(2.0))
    assert policy_of(fixed).settings.quanta_s[0] == pytest.approx(4e-3)


def test_mlfq_preempt_redoes_an_abandoned_decode_with_its_kv_kept() -> None:
    sched = mlfq("mlfq-preempt", base_quantum_ms=2.5)  # quanta 2.5, 5, 10 ms
    assert isinstance(sched.policy, MLFQPreemptPolicy)
    [req] = make_requests([1], [6])
    sched.add_request(req, 0.0)
    core, executor = make_engine(sched)
    core.step()  # prefill: 1 ms of 2.5
    core.step()  # decode: 2 ms of 2.5
    blocks = list(sched.kv.block_table(req.request_id))
    core.step()  # a third 1 ms would overrun 2.5 ms: abandoned, demoted to Q2
    assert policy_of(sched).num_abandoned == 1 and sched.level_of(req.request_id) == 1
    assert req.num_output_tokens == 2 and sched.kv.block_table(req.request_id) == blocks
    core.step()  # the same decode again, kept
    feeds = [(p.scheduled[0].start_pos, p.scheduled[0].token_ids) for p, _ in executor.steps]
    assert feeds[2] == feeds[3] and req.num_output_tokens == 3
    while not req.is_finished:
        core.step()
    assert req.num_output_tokens == 6 and sched.kv._kv.num_free_blocks == sched.kv._kv.num_total_blocks


def _finish_ms(policy: str, prompt_lens: list[int], output_lens: list[int],
               arrivals: list[float], **config: object) -> dict[str, float]:
    sched = mlfq(policy, max_batch_size=1, **config) if policy != "fcfs" else make_scheduler(
        "fcfs", cost=UNIT_COST, max_batch_size=1)
    run = serve(sched, make_requests(prompt_lens, output_lens, arrivals))
    return {r.request_id: round((r.finish_s or 0.0) * 1e3, 3) for r in run.finished}


def test_mlfq_lets_a_short_job_pass_a_long_one_where_fcfs_does_not() -> None:
    # The paper's point for MLFQ: a 3-token job arriving behind a 60-token one. FCFS (and the
    # batch-keeping variant) make it wait for all 60; MLFQ demotes the long job below Q1 and
    # the short one runs at its next iteration.
    args = ([1, 1], [60, 3], [0.0, 0.0105])
    fcfs = _finish_ms("fcfs", *args)
    assert fcfs["r1"] > fcfs["r0"] == pytest.approx(60.0)
    assert _finish_ms("mlfq-keep-batch", *args) == fcfs
    plain = _finish_ms("mlfq", *args)
    assert plain["r1"] < 20.0 and plain["r0"] == pytest.approx(63.0)


def test_mlfq_degrades_to_round_robin_on_equal_jobs() -> None:
    # Four equal 40-token jobs at once: FCFS finishes them 40 ms apart; the paper's MLFQ
    # (turns in a level, deep levels) runs them down the levels side by side, so none
    # finishes before ~130 ms and the mean JCT is far worse than FCFS's.
    args = ([1] * 4, [40] * 4, [0.0] * 4)
    fcfs = sorted(_finish_ms("fcfs", *args).values())
    assert fcfs == pytest.approx([40.0, 80.0, 120.0, 160.0])
    rr = sorted(_finish_ms("mlfq", *args, mlfq_variant="paper", starve_limit_s=0.0).values())
    assert rr[0] > 120.0 and sum(rr) > 1.3 * sum(fcfs)
