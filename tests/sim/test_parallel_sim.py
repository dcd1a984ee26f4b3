"""The cost model's tensor and pipeline parallelism, and the published 175B setup simulated
with two batches in flight."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from fastserve.args import engine_config
from fastserve.bench.workloads import WorkItem
from fastserve.clock import VirtualClock
from fastserve.core.cost_model import CostModel
from fastserve.core.kv.manager import KVCacheManager
from fastserve.core.policies import make_scheduler
from fastserve.engine.core import PipelinedEngineCore
from fastserve.sim.pipeline import PipelinedSimExecutor
from fastserve.sim.simulator import ample_blocks, make_requests, simulate_run

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "gpt3-175b_16xA100_tp8_pp2.json"
ONE = CostModel(fixed_s=0.2, per_prefill_token_s=2e-3, per_decode_s=2e-4, per_context_token_s=3e-6)


def test_tensor_parallelism_splits_compute_and_adds_two_all_reduces_per_layer() -> None:
    tp = dataclasses.replace(ONE, tensor_parallel_size=8, num_layers=96, hidden_bytes=24576,
                             allreduce_latency_s=2e-5, allreduce_bus_bytes_per_s=200e9)
    batch = (0, 16, 16 * 512)
    ring_s = 2e-5 + 2 * 7 / 8 * 16 * 24576 / 200e9
    assert math.isclose(tp.allreduce_s(16), ring_s)
    assert math.isclose(tp.iteration_s(*batch), ONE.iteration_s(*batch) / 8 + 2 * 96 * ring_s)


def test_pipeline_stages_split_layers_and_a_batch_passes_them_in_turn() -> None:
    pp = dataclasses.replace(ONE, pipeline_parallel_size=2, num_layers=96, hidden_bytes=24576,
                             p2p_latency_s=1e-5, p2p_bytes_per_s=25e9)
    batch = (256, 3, 900, 256 * 256)
    stage_s = ONE.iteration_s(*batch) / 2 + 1e-5 + 259 * 24576 / 25e9
    assert math.isclose(pp.stage_s(*batch), stage_s)
    assert math.isclose(pp.iteration_s(*batch), 2 * stage_s)
    assert ONE.stage_s(*batch) == ONE.iteration_s(*batch)  # one device: unchanged


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        CostModel(pipeline_parallel_size=4, num_layers=2)


def test_published_175b_setup_simulates_with_two_batches_in_flight() -> None:
    cost = CostModel.from_json(PROFILE)
    assert (cost.tensor_parallel_size, cost.pipeline_parallel_size) == (8, 2)
    per_token_s = cost.iteration_s(0, 16, 16 * 512)
    assert 0.02 < per_token_s < 0.06  # tens of ms per token, as published systems report
    workload = [WorkItem(0.0, 128, 128) for _ in range(32)]
    config = engine_config(policy="fcfs", max_batch_size=16)
    run = simulate_run(workload, config, cost, ample_blocks(workload, 16))
    assert len(run.finished) == 32
    makespan = max(r.finish_s or 0.0 for r in run.finished)

    # The same deployment running one batch at a time (request-level, as FasterTransformer).
    kv = KVCacheManager(ample_blocks(workload, 16), 16)
    scheduler = make_scheduler(config.scheduler, kv, cost)
    clock = VirtualClock()
    core = PipelinedEngineCore(scheduler, PipelinedSimExecutor(cost, clock=clock), clock, 1)
    for r in make_requests(workload):
        scheduler.add_request(r, 0.0)
    while scheduler.has_unfinished:
        core.step()
    assert makespan < 0.6 * clock.now()
