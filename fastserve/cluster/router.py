"""The fleet's routers as Ray Serve `RequestRouter`s: fastserve's policies
(`fastserve.fleet.policies`: fastserve, prefix-affinity, round-robin) wrapped in one adapter,
and Ray's own power of two choices, all in the same code path.

Each replica reports a `ReplicaStats` through Ray Serve's routing stats
(`EngineReplica.record_routing_stats`); Ray hands them to the router with each candidate
replica. The ingress passes each request's `RouteRequest` (prompt length and block hashes) as
the second argument of the call, where `choose_replicas` finds it.

A router lives in the process that holds the deployment handle (the fleet's ingress). It also
keeps the latest per-replica metrics (`RouterBoard`) for the ingress's `/metrics`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from fastserve.core.replica_stats import ReplicaStats
from fastserve.fleet.policies import make_router
from fastserve.fleet.router import Router, RouteRequest

logger = logging.getLogger(__name__)

_NO_PROMPT = RouteRequest("no-prompt", 1)  # /health, /v1/models: any replica will do
RAY_POW2 = "pow2"  # Ray Serve's default router; the other names are fastserve.fleet's policies
ROUTER_NAMES = ("fastserve", "prefix-affinity", "round-robin", RAY_POW2)

STATS_KEY = "stats"  # routing stats: the replica's ReplicaStats, as JSON
METRICS_KEY = "metrics"  # routing stats: the replica's /metrics samples (`metrics`)


class RouterBoard:
    """The routers living in this process, by application name: the ingress reads its
    replicas' latest routing stats here (Ray builds routers itself, lazily, inside the
    deployment handle, so there is no other way to reach the one it built).

    NOTE: process-local and keyed by the fleet's application name; one fleet per app name."""

    _routers: dict[str, RequestRouter] = {}

    @classmethod
    def publish(cls, router: RequestRouter) -> None:
        cls._routers[router.app_name] = router

    @classmethod
    def replica_stats(cls, app_name: str) -> dict[str, dict[str, Any]]:
        """Each running replica's latest routing stats (empty until the first request)."""
        router = cls._routers.get(app_name)
        if router is None:
            return {}
        return {rid.unique_id: dict(r.routing_stats or {})
                for rid, r in router.curr_replicas.items()}


def request_router_path(name: str) -> str:
    """The `RequestRouter` class for `--router NAME`, as the import path Ray Serve loads in
    every process that holds a handle."""
    if name not in ROUTER_NAMES:
        raise ValueError(f"router: unknown router {name!r}; choose one of {', '.join(ROUTER_NAMES)}")
    cls = RayPowerOfTwoRouter if name == RAY_POW2 else FleetRequestRouter
    return f"{cls.__module__}:{cls.__qualname__}"


def route_of(pending: PendingRequest | None) -> RouteRequest | None:
    """The request's `RouteRequest`, passed by the ingress as the call's second argument."""
    if pending is None or len(pending.args) < 2:
        return None
    route = pending.args[1]
    return route if isinstance(route, RouteRequest) else None


class RayPowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router, unchanged but for publishing itself on the board."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        RouterBoard.publish(self)


class FleetRequestRouter(RequestRouter):
    """A `fastserve.fleet` policy deciding for Ray Serve.

    `request_router_kwargs`: `policy` (a name for `make_router`) and `seed`. Each candidate's
    latest `ReplicaStats` is handed to the policy before it ranks; Ray then sends the request
    to the first ranked replica that accepts it, and `on_request_routed` books it there.
    """

    def initialize_state(self, policy: str = "fastserve", seed: int = 0, **options: Any) -> None:
        self.policy: Router = make_router(policy, seed=seed, **options)
        self._stats_time: dict[str, float] = {}  # per replica: the snapshot the policy has

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for rid in [rid for rid in self.policy.views if rid not in live]:
            self.policy.remove(rid)
            self._stats_time.pop(rid, None)
        RouterBoard.publish(self)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for rid, replica in by_id.items():
            self._refresh(rid, replica)
        route = route_of(pending_request)
        now = time.time()
        ranked = self.policy.rank(route or _NO_PROMPT, now, by_id)
        if route is not None:
            # NOTE: booked here, not in `on_request_routed`: Ray calls that only under strict
            # max_ongoing_requests. The replicas never refuse (their max_ongoing_requests is
            # far above any engine queue: the engine answers 429 itself), so Ray sends every
            # request to the first rank's replica.
            self.policy.note_sent(route, ranked[0], now)
        rest = [rid for rid in by_id if rid not in ranked]  # a policy may rank only a sample
        return [[by_id[rid]] for rid in ranked] + ([[by_id[rid] for rid in rest]] if rest else [])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.remove(replica_id.unique_id)
        self._stats_time.pop(replica_id.unique_id, None)

    def _refresh(self, rid: str, replica: RunningReplica) -> None:
        """Hand the policy this replica's snapshot when it is newer than the one it has."""
        raw = (replica.routing_stats or {}).get(STATS_KEY)
        if not raw or raw.get("time_s", 0.0) <= self._stats_time.get(rid, -1.0):
            return
        try:
            stats = ReplicaStats.from_json({**raw, "replica_id": rid})  # named as Ray names it
        except (TypeError, ValueError, KeyError) as exc:
            # NOTE: a replica of another fastserve version (a rolling update) must not stop
            # the routing: the policy goes on with what it knew of that replica.
            logger.warning("replica %s: unreadable routing stats (%s); ignored", rid, exc)
            self._stats_time[rid] = raw.get("time_s", 0.0)
            return
        self.policy.update(stats)
        self._stats_time[rid] = stats.time_s
