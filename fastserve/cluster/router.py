"""Which replica serves a request: the ingress's `ReplicaTable`, running a `fastserve.fleet`
policy (fastserve, prefix-affinity, round-robin, pow2) over the replicas Ray Serve runs.

Each replica reports, every stats period, its `ReplicaStats`, its `/metrics` samples and the
address of its HTTP server (`EngineReplica.record_routing_stats`); Ray Serve's controller
broadcasts them to every deployment handle. The ingress holds one handle, never called: the
request router Ray builds inside it (`ReplicaWatcher`) only keeps the latest replicas and
their stats, which the ingress reads on its own event loop (`RouterBoard`): no round trip per
request, and none of the handle's per-request machinery.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import RequestRouter, RunningReplica

from fastserve.core.replica_stats import ReplicaStats
from fastserve.fleet.policies import ROUTERS
from fastserve.fleet.router import Router, RouteRequest

logger = logging.getLogger(__name__)

ROUTER_NAMES = tuple(ROUTERS)  # fastserve, pow2, prefix-affinity, round-robin

STATS_KEY = "stats"  # routing stats: the replica's ReplicaStats, as JSON
METRICS_KEY = "metrics"  # routing stats: the replica's /metrics samples (`metrics`)
ADDRESS_KEY = "address"  # routing stats: the replica's HTTP server, "http://host:port"

# A replica the ingress could not connect to is left out this long (or until Ray Serve's
# controller, told of its death, drops it or its restart reports a new address).
_DOWN_S = 5.0


class RouterBoard:
    """The watchers living in this process, by application name: the ingress reads its
    replicas' latest routing stats here (Ray builds request routers itself, inside the
    deployment handle, so there is no other way to reach the one it built).

    NOTE: process-local and keyed by the fleet's application name; one fleet per app name."""

    _routers: dict[str, RequestRouter] = {}

    @classmethod
    def publish(cls, router: RequestRouter) -> None:
        cls._routers[router.app_name] = router

    @classmethod
    def replica_stats(cls, app_name: str) -> dict[str, dict[str, Any]]:
        """Each running replica's latest routing stats (empty before the handle's first
        update from the controller)."""
        router = cls._routers.get(app_name)
        if router is None:
            return {}
        return {rid.unique_id: r.routing_stats or {} for rid, r in router.curr_replicas.items()}


class ReplicaWatcher(PowerOfTwoChoicesRequestRouter):
    """The request router Ray Serve builds in the ingress's handle: it routes nothing (the
    handle is never called), and publishes itself on the board as replicas come and go and
    their stats change."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        RouterBoard.publish(self)


WATCHER_PATH = f"{ReplicaWatcher.__module__}:{ReplicaWatcher.__qualname__}"


@dataclass(frozen=True)
class Target:
    """The replica chosen for a request."""

    replica_id: str
    url: str  # its HTTP server, "http://host:port"
    request_id: str = ""  # the request as the router noted it sent there


class ReplicaTable:
    """The replicas the ingress can send to, where each listens, and the policy that picks
    one. Read from the board at each choice; used on the ingress's event loop only."""

    def __init__(self, app_name: str, policy: Router) -> None:
        self.app_name = app_name
        self.policy = policy
        # This ingress's name to the replicas (`proxy.SENDER_HEADER`): they count what they
        # take in from it, and the policy keeps counting a request until they have it.
        self.sender = uuid.uuid4().hex[:16]
        policy.source = self.sender
        self.urls: dict[str, str] = {}  # replica id -> its HTTP server
        self._stats_time: dict[str, float] = {}  # per replica: the snapshot the policy has
        self._down_until: dict[str, float] = {}  # replicas that refused a connection
        self._ids = itertools.count()

    def choose(self, route: RouteRequest | None, exclude: frozenset[str] = frozenset()
               ) -> Target | None:
        """The replica for a request (None: no replica to send to, now), noted as sent there.
        `route` is its prompt's `RouteRequest` (None for a request that has none)."""
        self.refresh()
        now = time.time()
        ids = [rid for rid in self.urls
               if rid not in exclude and self._down_until.get(rid, 0.0) <= now]
        if not ids:
            return None
        # NOTE: a request without a prompt is booked too (as one token): pow2 and the
        # imbalance bound count what was sent since the last snapshot.
        route = route or RouteRequest(f"no-prompt-{next(self._ids)}", 1)
        rid = self.policy.rank(route, now, ids)[0]
        self.policy.note_sent(route, rid, now)
        return Target(rid, self.urls[rid], route.request_id)

    def forget(self, target: Target) -> None:
        """The request sent to `target` never reached its engine (the connection failed, or
        the replica refused it): not counted there any more."""
        self.policy.forget(target.request_id, target.replica_id)

    def mark_down(self, replica_id: str) -> None:
        """A connection to this replica failed: leave it out for a while."""
        self._down_until[replica_id] = time.time() + _DOWN_S

    def refresh(self) -> None:
        """Take the board's replicas: new ones join, gone ones leave, newer stats reach the
        policy."""
        live = RouterBoard.replica_stats(self.app_name)
        for rid in [rid for rid in self.urls if rid not in live]:
            self.urls.pop(rid)
            self.policy.remove(rid)
            self._stats_time.pop(rid, None)
            self._down_until.pop(rid, None)
        for rid, stats in live.items():
            url = stats.get(ADDRESS_KEY)
            if not url:  # not reported yet: not reachable yet
                continue
            if self.urls.get(rid) != url:
                self.urls[rid] = url
                self._down_until.pop(rid, None)
            self._update(rid, stats.get(STATS_KEY))

    def _update(self, rid: str, raw: dict[str, Any] | None) -> None:
        """Hand the policy this replica's snapshot when it is newer than the one it has."""
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
