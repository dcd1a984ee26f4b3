"""The simulator's KV swap model: copy time from bytes and bandwidth, one copy engine in plan
order, iterations waiting only for the copies touching their own blocks; and KV counters."""

from __future__ import annotations

import pytest

from fastserve.args import engine_config
from fastserve.bench.metrics import METRIC_KEYS
from fastserve.bench.runner import run_policies
from fastserve.bench.workloads import WorkItem, zipf_workload
from fastserve.clock import VirtualClock
from fastserve.core.cost_model import CostModel
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.request import SamplingParams
from fastserve.sim.executor import SimExecutor
from fastserve.sim.simulator import ample_blocks, simulate_run

# 1 ms of compute per iteration; a block moves in 2 ms.
COST = CostModel(fixed_s=1e-3, per_prefill_token_s=0.0, per_decode_s=0.0,
                 per_context_token_s=0.0, kv_block_bytes=2_000_000, swap_bytes_per_s=1e9)
PARAMS = SamplingParams(max_tokens=4)


def decode(request_id: str, block_ids: list[int]) -> ScheduledRequest:
    return ScheduledRequest(request_id, [1], 5, block_ids, PARAMS, 1)


def test_default_bandwidth_is_pcie4_x16() -> None:
    assert CostModel().swap_bytes_per_s == 25e9
    assert COST.swap_s(3) == pytest.approx(6e-3)


def test_an_iteration_waits_only_for_copies_into_its_blocks() -> None:
    clock = VirtualClock()
    ex = SimExecutor(COST, clock=clock)
    # Upload two blocks for a job that runs in this iteration: it waits the 4 ms.
    out = ex.execute(SchedulerOutput([decode("a", [0, 1])], swap_in=[(10, 0), (11, 1)]))
    assert out.swap_wait_s == pytest.approx(4e-3)
    assert out.duration_s == pytest.approx(5e-3)
    clock.advance(out.duration_s)
    # Uploads for a later job overlap this iteration: no wait.
    out = ex.execute(SchedulerOutput([decode("a", [0, 1])], swap_in=[(12, 5), (13, 6), (14, 7)]))
    assert out.swap_wait_s == 0.0 and out.duration_s == pytest.approx(1e-3)
    clock.advance(out.duration_s)
    # The next iteration reads them: it waits only for what has not landed (6 - 1 ms).
    out = ex.execute(SchedulerOutput([decode("b", [5, 6, 7])]))
    assert out.swap_wait_s == pytest.approx(5e-3)


def test_copies_run_in_plan_order_on_one_engine() -> None:
    clock = VirtualClock()
    ex = SimExecutor(COST, clock=clock)
    # Two swap-outs (4 ms) go first, then the swap-in the batch needs (2 ms more).
    out = ex.execute(SchedulerOutput([decode("a", [3])], swap_out=[(0, 0), (1, 1)],
                                     swap_in=[(5, 3)]))
    assert out.swap_wait_s == pytest.approx(6e-3)
    # The copy engine drains while the engine idles.
    clock.advance(out.duration_s + 1.0)
    out = ex.execute(SchedulerOutput([decode("a", [0, 1, 3])], swap_out=[(7, 9)]))
    assert out.swap_wait_s == 0.0


@pytest.mark.parametrize("kv_policy", ["proactive", "reactive", "defer", "recompute"])
def test_tight_memory_runs_count_swaps_and_free_everything(kv_policy: str) -> None:
    workload = zipf_workload(200, 50.0, 4.0, 1.0, 128, 128, seed=1)
    cost = CostModel(kv_block_bytes=1 << 20)
    config = engine_config(policy="skip-join-mlfq", mlfq_variant="paper", kv_policy=kv_policy,
                           num_host_blocks=5000)
    peak = simulate_run(workload, config, cost, ample_blocks(workload, 16)).peak_kv_blocks
    run = simulate_run(workload, config, cost, max(16, peak // 4))
    assert len(run.finished) == 200
    assert run.peak_kv_blocks <= max(16, peak // 4)
    if kv_policy in ("proactive", "reactive"):
        assert run.swap_out_blocks == run.swap_in_blocks > 0
    else:
        assert run.swap_out_blocks == run.swap_in_blocks == 0 and run.swap_wait_s == 0.0
    assert 0 < run.mean_batch_size <= 16


def test_bench_results_carry_the_kv_counters() -> None:
    workload = zipf_workload(60, 50.0, 4.0, 1.0, 64, 64, seed=2)
    cost = CostModel(kv_block_bytes=1 << 20)
    config = engine_config(num_device_blocks=24, num_host_blocks=1000)
    results = run_policies(workload, ["skip-join-mlfq:kv-policy=proactive",
                                      "skip-join-mlfq:kv-policy=defer"], config, "sim", cost, 24)
    for metrics in results.values():
        assert set(metrics) == set(METRIC_KEYS)
        assert 0 < metrics["peak_kv_blocks"] <= 24
    assert results["skip-join-mlfq:kv-policy=defer"]["swap_out_blocks"] == 0


def test_run_records_how_much_kv_its_batches_read() -> None:
    # Two jobs of 16 prompt + 16 output tokens (block size 16), arriving together: their
    # prefill reads one block each, their 15 decodes (the 17th token on) two each.
    workload = [WorkItem(0.0, 16, 16), WorkItem(0.0, 16, 16)]
    run = simulate_run(workload, engine_config(policy="fcfs"), COST, 100)
    assert sum(run.batch_kv_s.values()) == pytest.approx(run.busy_s)
    assert set(run.batch_kv_s) == {2, 4}  # prefill: one block each; then two each
    assert run.share_batch_kv_over(4) == 0.0
    assert run.share_batch_kv_over(2) == pytest.approx(15 / 16)  # 15 decode iterations of 16
    assert run.share_batch_kv_over(1) == 1.0


def test_inline_copies_add_their_time_to_the_iteration() -> None:
    # A CPU with no idle core copies on the compute's cores, before the iteration: even the
    # uploads for a later job hold this one up, and a plan of copies alone takes their time.
    inline = CostModel(**{**COST.__dict__, "copies_overlap": False})
    clock = VirtualClock()
    ex = SimExecutor(inline, clock=clock)
    out = ex.execute(SchedulerOutput([decode("a", [0, 1])], swap_in=[(12, 5), (13, 6)],
                                     swap_out=[(9, 20)]))
    assert out.swap_wait_s == pytest.approx(6e-3)
    assert out.duration_s == pytest.approx(7e-3)
    clock.advance(out.duration_s)
    out = ex.execute(SchedulerOutput([], swap_out=[(5, 21)]))
    assert out.duration_s == out.swap_wait_s == pytest.approx(2e-3)
    clock.advance(out.duration_s)
    # Nothing is left in flight: the next iteration reads the uploaded blocks at once.
    out = ex.execute(SchedulerOutput([decode("b", [5, 6])]))
    assert out.swap_wait_s == 0.0 and out.duration_s == pytest.approx(1e-3)
