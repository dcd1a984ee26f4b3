"""`fastserve bench --executor sim --replicas N --router R`: a fleet of simulated replicas
behind each router, on the identical workload."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fastserve.bench.metrics import JobTimes, KVTotals, compute_metrics
from fastserve.bench.runner import policy_config
from fastserve.bench.workloads import scale_to_load
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.fleet import make_router
from fastserve.fleet.trace import RecordingRouter
from fastserve.request import WorkItem
from fastserve.sim.fleet import DEFAULT_STATS_PERIOD_S, simulate_fleet
from fastserve.sim.simulator import ample_blocks


def fleet_workload(workload: Sequence[WorkItem], load: float, num_replicas: int,
                   cost: CostModel, max_batch_size: int) -> list[WorkItem]:
    """`workload`'s arrivals scaled so that each of `num_replicas` replicas sees offered load
    `load` (the fleet's is `load` x replicas: work / one engine's capacity at full batch)."""
    return scale_to_load(workload, load * num_replicas, cost, max_batch_size)


def run_fleet(
    workload: Sequence[WorkItem],
    policies: Sequence[str],
    routers: Sequence[str],
    config: EngineConfig,
    cost: CostModel,
    num_replicas: int,
    num_device_blocks: int | None = None,
    seed: int = 0,
    stats_period_s: float = DEFAULT_STATS_PERIOD_S,
    progress: bool = False,
    trace_path: str | Path | None = None,
) -> dict[str, dict[str, float]]:
    """Metrics per (policy, router), keyed by the router spec when one policy runs and by
    `policy/router` otherwise. Each run is a fresh fleet; `trace_path` records the first
    run's router (`fastserve.fleet.trace`)."""
    if not routers:
        raise ValueError("--router must name at least one router")
    configs = {spec: policy_config(config, spec) for spec in policies}  # fail before running
    for spec in routers:
        make_router(spec, seed)  # fail before running
    blocks = num_device_blocks or ample_blocks(workload, config.cache.block_size)
    results: dict[str, dict[str, float]] = {}
    for policy, cfg in configs.items():
        for spec in routers:
            router = make_router(spec, seed)
            recorder = None
            if trace_path is not None and not results:
                router = recorder = RecordingRouter(router, spec)
            run = simulate_fleet(workload, cfg, cost, num_replicas, router, blocks,
                                 stats_period_s, progress=progress)
            if recorder is not None:
                recorder.write(trace_path)  # type: ignore[arg-type]
            jobs = [JobTimes.from_request(r) for r in run.finished]
            kv = KVTotals(prefix_query_tokens=run.prefix_query_tokens,
                         prefix_hit_tokens=run.prefix_hit_tokens)
            metrics = compute_metrics(jobs, num_requests=len(workload), kv=kv)
            metrics["prefix_hit_rate"] = (run.prefix_hit_tokens / run.prefix_query_tokens
                                          if run.prefix_query_tokens else 0.0)
            busy = run.busy_s
            metrics["busy_max_over_mean"] = max(busy) / (sum(busy) / len(busy)) \
                if sum(busy) > 0 else 1.0
            results[spec if len(configs) == 1 else f"{policy}/{spec}"] = metrics
    return results
