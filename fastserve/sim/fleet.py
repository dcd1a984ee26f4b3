"""A fleet of simulated replicas behind one router, on virtual clocks.

Each replica is the production engine core (`build_engine_core`: the configured scheduler, KV
manager and step loop) over a `SimExecutor` with its own virtual clock; the router is the same
`fastserve.fleet` object the Ray deployment runs. What the router sees is what it would see
there: every `stats_period_s` each replica's `Scheduler.replica_stats` snapshot (the state
after the iteration it is running), and between two snapshots its own bookkeeping of what it
sent. So what the router buys at 8-64 replicas is measured where a machine cannot run them.

Replicas share nothing but the router, so between two router events (an arrival, a stats
tick) each replica is stepped on its own up to that time: exact, and as fast as N separate
simulations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from fastserve.clock import VirtualClock
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import host_pool_blocks
from fastserve.engine.core import EngineCore, build_engine_core
from fastserve.fleet.router import Router, RouteRequest
from fastserve.request import Request, WorkItem
from fastserve.sim.executor import SimExecutor
from fastserve.sim.simulator import make_requests

DEFAULT_STATS_PERIOD_S = 0.1
DEFAULT_MAX_PREFIX_HASHES = 8192


class SimReplica:
    """One replica: an engine core on its own virtual clock."""

    def __init__(self, replica_id: str, config: EngineConfig, cost: CostModel,
                 num_device_blocks: int, start_s: float) -> None:
        self.replica_id = replica_id
        self.clock = VirtualClock(start_s)
        self.core: EngineCore = build_engine_core(
            config, SimExecutor(cost, clock=self.clock), cost, self.clock, num_device_blocks,
            host_pool_blocks(config.cache, cost.kv_block_bytes))
        self.finished: list[Request] = []
        self.is_stuck = False  # nothing could run: waits for an arrival

    def add(self, req: Request, now: float) -> None:
        self.clock.advance_to(now)
        self.core.scheduler.add_request(req, self.clock.now())
        self.is_stuck = False

    def run_until(self, t: float) -> None:
        """Step every iteration that starts before `t`; an idle replica's clock moves to `t`."""
        sched = self.core.scheduler
        while sched.has_unfinished and not self.is_stuck and self.clock.now() < t:
            n = self.core.num_iterations
            for req in self.core.step():
                if req.is_finished:
                    self.finished.append(req)
            if self.core.num_iterations == n and self.core.num_in_flight == 0:
                self.is_stuck = True
        self.clock.advance_to(t)

    def run_to_end(self) -> None:
        while self.core.scheduler.has_unfinished and not self.is_stuck:
            self.run_until(float("inf"))


@dataclass
class FleetRun:
    """What a simulated fleet produced."""

    finished: list[Request]  # every replica's, in no particular order
    placements: dict[str, str]  # request id -> replica id
    num_unfinished: int  # left on a replica that could run nothing more
    busy_s: list[float] = field(default_factory=list)  # per replica, time in iterations
    prefix_query_tokens: int = 0  # tokens of the jobs started, over the fleet
    prefix_hit_tokens: int = 0  # of those, found cached
    num_stats: int = 0  # snapshots the router got


def replica_ids(num_replicas: int) -> list[str]:
    width = len(str(max(0, num_replicas - 1)))
    return [f"replica-{i:0{width}d}" for i in range(num_replicas)]


def simulate_fleet(
    workload: Sequence[WorkItem],
    config: EngineConfig,
    cost: CostModel,
    num_replicas: int,
    router: Router,
    num_device_blocks: int,
    stats_period_s: float = DEFAULT_STATS_PERIOD_S,
    max_prefix_hashes: int = DEFAULT_MAX_PREFIX_HASHES,
    progress: bool = False,
) -> FleetRun:
    """Serve `workload` on `num_replicas` replicas of `config`, each request placed by
    `router` at its arrival. Requests carry their times on the shared virtual time line."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not stats_period_s > 0:
        raise ValueError(f"stats_period_s must be > 0, got {stats_period_s}")
    # As in `simulate_run`: only jobs whose prompts share blocks (Mooncake) use the cache.
    caching = config.cache.enable_prefix_caching and any(w.hash_ids for w in workload)
    config = dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, enable_prefix_caching=caching))
    pending = sorted(make_requests(workload), key=lambda r: r.arrival_s)
    start_s = pending[0].arrival_s if pending else 0.0
    replicas = {rid: SimReplica(rid, config, cost, num_device_blocks, start_s)
                for rid in replica_ids(num_replicas)}
    for r in pending:  # refused up front, as `add_request` would refuse it later
        next(iter(replicas.values())).core.scheduler.check_fits(r)
    block_size = config.cache.block_size
    placements: dict[str, str] = {}
    num_stats = 0

    def tick(t: float) -> None:
        nonlocal num_stats
        for rep in replicas.values():
            rep.run_until(t)
            router.update(rep.core.scheduler.replica_stats(rep.replica_id, t, max_prefix_hashes))
            num_stats += 1

    next_tick_s = start_s
    bar = tqdm(total=len(pending), desc=f"fleet x{num_replicas}", unit="req",
               disable=not progress, leave=False)
    for req in pending:
        t = req.arrival_s
        while next_tick_s <= t:
            tick(next_tick_s)
            next_tick_s += stats_period_s
        for rep in replicas.values():
            rep.run_until(t)
        route = (RouteRequest.from_tokens(req.request_id, req.prompt_token_ids, block_size,
                                          req.cache_salt) if caching
                 else RouteRequest(req.request_id, req.num_prompt_tokens))
        rid = router.choose(route, t)
        placements[req.request_id] = rid
        replicas[rid].add(req, t)
        bar.update()
    bar.close()
    for rep in replicas.values():
        rep.run_to_end()
    finished = [r for rep in replicas.values() for r in rep.finished]
    scheds = [rep.core.scheduler for rep in replicas.values()]
    return FleetRun(
        finished=finished,
        placements=placements,
        num_unfinished=len(pending) - len(finished),
        busy_s=[rep.core.busy_s for rep in replicas.values()],
        prefix_query_tokens=sum(s.stats().kv.num_prefix_query_tokens for s in scheds),
        prefix_hit_tokens=sum(s.stats().kv.num_prefix_hit_tokens for s in scheds),
        num_stats=num_stats,
    )
