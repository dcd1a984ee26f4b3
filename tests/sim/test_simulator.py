"""The simulator: the production scheduler and engine loop on a virtual clock."""

from __future__ import annotations

import pytest

from fastserve.args import engine_config
from fastserve.bench.workloads import WorkItem, zipf_workload
from fastserve.core.cost_model import CostModel
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.core.policies import POLICY_CLASSES
from fastserve.request import FinishReason, Request, SamplingParams
from fastserve.sim.executor import SimExecutor
from fastserve.sim.simulator import ample_blocks, simulate

# Round numbers so the expected times can be worked out by hand.
COST = CostModel(fixed_s=1.0, per_prefill_token_s=0.1, per_prefill_token2_s=0.001,
                 per_decode_s=0.5, per_context_token_s=0.01)


def finish(r: Request) -> float:
    assert r.finish_s is not None
    return r.finish_s


def first_token(r: Request) -> float:
    assert r.first_token_s is not None
    return r.first_token_s


def test_one_request_takes_a_prefill_plus_its_decodes() -> None:
    (req,) = simulate([WorkItem(2.0, 10, 5)], engine_config(policy="fcfs"), COST, 100)
    prefill = 1.0 + 0.1 * 10 + 0.001 * 10**2  # 2.1 s, gives the first token
    # Decode k (k = 1..4) feeds one token at position 9 + k: context 10 + k tokens.
    decodes = sum(1.0 + 0.5 + 0.01 * (10 + k) for k in range(1, 5))  # 6.5 s
    assert req.first_token_s == pytest.approx(2.0 + prefill)
    assert req.finish_s == pytest.approx(2.0 + prefill + decodes)
    assert req.num_output_tokens == 5 and req.finish_reason is FinishReason.LENGTH
    assert req.num_preemptions == 0


def test_the_clock_jumps_over_idle_gaps() -> None:
    a, b = simulate([WorkItem(0.0, 10, 1), WorkItem(100.0, 10, 1)], engine_config(policy="fcfs"),
                    COST, 100)
    assert a.finish_s == pytest.approx(2.1)
    assert b.finish_s == pytest.approx(102.1)  # served when it arrives, alone


def test_a_request_arriving_mid_iteration_waits_for_the_next() -> None:
    a, b = simulate([WorkItem(0.0, 10, 1), WorkItem(1.0, 10, 1)], engine_config(policy="fcfs"),
                    COST, 100)
    assert a.finish_s == pytest.approx(2.1)
    assert b.first_token_s == pytest.approx(4.2)  # it arrived during a's prefill
    assert finish(b) - b.arrival_s == pytest.approx(3.2)


@pytest.mark.parametrize("policy", sorted(POLICY_CLASSES))
def test_every_policy_finishes_every_job(policy: str) -> None:
    wl = zipf_workload(200, rate=50.0, cv=2.0, theta=1.0, max_input_len=64, max_output_len=64, seed=1)
    done = simulate(wl, engine_config(policy=policy, max_batch_size=4), CostModel(), ample_blocks(wl, 16))
    assert len(done) == len(wl)
    assert sorted(r.num_output_tokens for r in done) == sorted(w.output_len for w in wl)
    assert all(finish(r) >= first_token(r) >= r.arrival_s for r in done)


def test_skip_join_mlfq_runs_a_short_job_ahead_of_a_long_one() -> None:
    # A long job is running when a short one arrives, and the batch holds one job: FCFS runs
    # the long job to the end while the short one waits; skip-join MLFQ preempts it.
    wl = [WorkItem(0.0, 8, 500), WorkItem(0.1, 8, 2)]  # the long one runs ~1.2 s alone
    results = {}
    for policy in ("fcfs", "skip-join-mlfq"):
        done = simulate(wl, engine_config(policy=policy, max_batch_size=1), CostModel(), 100)
        results[policy] = {r.request_id: r for r in done}
    short_fcfs = results["fcfs"]["sim-1"]
    short_mlfq = results["skip-join-mlfq"]["sim-1"]
    assert finish(short_mlfq) < finish(short_fcfs)
    assert results["skip-join-mlfq"]["sim-0"].num_preemptions >= 1
    assert results["fcfs"]["sim-0"].num_preemptions == 0


def test_fcfs_and_orca_differ_under_tight_kv() -> None:
    # 4 jobs of 4 + 12 tokens = 4 blocks each, 10 blocks in all. Orca reserves all 4 blocks at
    # admission, so only 2 start; FCFS allocates as they grow, so all 4 start at once.
    wl = [WorkItem(0.0, 4, 12) for _ in range(4)]
    first = {}
    for policy in ("fcfs", "orca"):
        cfg = engine_config(policy=policy, block_size=4, kv_policy="recompute")
        done = simulate(wl, cfg, COST, num_device_blocks=10)
        assert len(done) == 4 and all(r.num_output_tokens == 12 for r in done)
        first[policy] = sorted(first_token(r) for r in done)
        if policy == "orca":
            assert all(r.num_preemptions == 0 for r in done)
            finishes = sorted(finish(r) for r in done)
            assert first["orca"][2] > finishes[0]  # the third job waits for blocks to free
    assert first["fcfs"][3] == pytest.approx(first["fcfs"][0])  # one prefill for all four


def test_jobs_the_engine_would_reject_are_rejected() -> None:
    with pytest.raises(ValueError, match="needs 3 KV blocks but the cache has 2"):
        simulate([WorkItem(0.0, 40, 8)], engine_config(policy="fcfs"), COST, num_device_blocks=2)



def test_prompts_over_the_token_budget_prefill_in_chunks() -> None:
    """A 40-token prompt at a 16-token budget: three prefill iterations, then its tokens."""
    [alone] = simulate([WorkItem(0.0, 40, 8)], engine_config(policy="fcfs"), COST,
                       num_device_blocks=100)
    [chunked] = simulate([WorkItem(0.0, 40, 8)],
                         engine_config(policy="fcfs", max_num_batched_tokens=16), COST,
                         num_device_blocks=100)
    assert chunked.num_output_tokens == alone.num_output_tokens == 8
    assert chunked.first_token_s is not None and alone.first_token_s is not None
    # Two more iterations' fixed cost before the first token; the rest is the same work.
    assert chunked.first_token_s > alone.first_token_s + COST.fixed_s


def test_sim_executor_predicts_the_cost_model_and_emits_no_eos() -> None:
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    plan = SchedulerOutput(scheduled=[
        ScheduledRequest("a", [1] * 10, 0, [0], p, 0),  # prefill of 10
        ScheduledRequest("b", [1] * 6, 0, [1], p, 0),  # prefill of 6
        ScheduledRequest("c", [3], 20, [2, 3], p, 4),  # decode at context 21
    ])
    out = SimExecutor(COST, vocab_size=100).execute(plan)
    assert out.duration_s == pytest.approx(COST.iteration_s(16, 1, 21, 100 + 36))
    assert out.sampled_token_ids == [99, 99, 99]
    assert SimExecutor(COST).execute(SchedulerOutput(scheduled=[])).duration_s == 0.0
