"""The fleet: several replicas of one model behind a router that knows their MLFQ levels.

Pure Python (no torch, no Ray, no clock), so the simulator and the Ray Serve deployment run
the same router. Start at `fastserve.fleet.router` (the interface) and `make_router`.
"""

from fastserve.core.replica_stats import ReplicaModel, ReplicaStats
from fastserve.fleet.policies import ROUTERS, make_router
from fastserve.fleet.router import ReplicaView, Router, RouteRequest

__all__ = ["ROUTERS", "ReplicaModel", "ReplicaStats", "ReplicaView", "RouteRequest", "Router",
           "make_router"]
