"""One engine replica of the fleet: a Ray Serve deployment running the single server's app.

Each replica builds the engine (`AsyncLLM`) and the same FastAPI app `fastserve serve` serves
(`build_app`), and answers the requests the ingress forwards by running them through that app
in-process (`asgi.run_app`): same validation, errors, streams and metrics as one server.
Ray Serve places the replicas, restarts one whose process dies or whose `check_health` fails,
and collects `record_routing_stats` for the router.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from fastserve.args import engine_config_from_args
from fastserve.cluster.asgi import ForwardedRequest, ResponseStart, run_app
from fastserve.cluster.metrics import replica_samples
from fastserve.cluster.router import METRICS_KEY, RAY_POW2, STATS_KEY, request_router_path
from fastserve.core.replica_stats import ReplicaStats
from fastserve.engine.async_llm import AsyncLLM
from fastserve.fleet.router import RouteRequest
from fastserve.server.app import build_app

logger = logging.getLogger(__name__)

REPLICA_DEPLOYMENT = "engine"  # the deployment's name in the fleet's Ray Serve application
# Each replica runs its request handlers on Ray Serve's own event loop, not on a second one
# in another thread (one thread hop less per request and per streamed chunk; Ray Serve's
# "throughput optimized" setting). The engine has its own thread either way.
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica is built from (pickled to each replica's process)."""

    engine_args: argparse.Namespace  # the `fastserve serve` engine flags, as parsed
    served_model_name: str
    api_key: str | None
    max_body_bytes: int
    grace_period_s: float
    tool_call_parser: str = "auto"  # the format of the model's tool calls (server/tools)
    reasoning_parser: str = "auto"  # split <think> blocks from the answer (server/reasoning)
    trust_request_chat_template: bool = False  # chat requests may bring their own template
    metrics_require_key: bool = False  # /metrics and the API's documents need the key too
    # The prefix cache's hashes a replica reports at most (the most recently used ones).
    max_prefix_hashes: int = 8192
    # A stream's chunks go to the ingress at most once per this many seconds after its first
    # (`asgi.run_app`): each Ray message costs the replica and the ingress far more CPU than
    # a token's SSE bytes.
    stream_batch_s: float = 0.05


class EngineReplica:
    """The deployment's class (`deployment()` wraps it for Ray Serve)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.llm = AsyncLLM(engine_config_from_args(spec.engine_args))
        self.app = build_app(self.llm, spec.served_model_name, api_key=spec.api_key,
                             max_body_bytes=spec.max_body_bytes,
                             tool_call_parser=spec.tool_call_parser,
                             reasoning_parser=spec.reasoning_parser,
                             trust_request_chat_template=spec.trust_request_chat_template,
                             metrics_require_key=spec.metrics_require_key,
                             # NOTE: a stored response would live on one replica, and the
                             # router does not send its follow-up there: none are stored
                             responses_store_mib=0)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        logger.info("replica %s serving (pid %d)", self.replica_id, os.getpid())

    async def __call__(
        self, req: ForwardedRequest, route: RouteRequest | None = None
    ) -> AsyncIterator[ResponseStart | bytes]:
        """One forwarded HTTP request (`route` is for the router only)."""
        async for item in run_app(self.app, req, self.spec.stream_batch_s):
            yield item

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve asks every stats period: the router's `ReplicaStats` and this replica's
        `/metrics` samples."""
        stats = await self._replica_stats()
        registry = self.app.state.serving.metrics.registry
        return {STATS_KEY: stats.to_json(), METRICS_KEY: replica_samples(registry)}

    async def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine loop died."""
        if not self.llm.is_healthy:
            raise RuntimeError(f"engine is not running: {self.llm.dead_reason}")

    def pid(self) -> int:
        """This replica's process id (tests kill it)."""
        return os.getpid()

    async def __del__(self) -> None:
        """Ray Serve's graceful stop: let running requests finish within the grace period."""
        await self.llm.shutdown(grace_s=self.spec.grace_period_s)

    async def _replica_stats(self) -> ReplicaStats:
        scheduler = self.llm.engine.scheduler
        # NOTE: read on the engine thread, between iterations (the scheduler is not
        # thread-safe); `_call` is AsyncLLM's way to run a function there.
        stats: ReplicaStats = await self.llm._call(
            lambda: scheduler.replica_stats(self.replica_id, time.time(),
                                            max_prefix_hashes=self.spec.max_prefix_hashes))
        return stats


def deployment(spec: ReplicaSpec, num_replicas: int, router: str, num_cpus: float,
               stats_period_s: float) -> serve.Application:
    """The fleet's application: `num_replicas` engine replicas behind `router`."""
    settings: dict[str, Any] = {
        "request_router_class": request_router_path(router),
        "request_router_kwargs": {} if router == RAY_POW2 else {"policy": router},
        "request_routing_stats_period_s": stats_period_s,
        "request_routing_stats_timeout_s": max(5.0, 4 * stats_period_s),
    }
    router_config = RequestRouterConfig(**settings)
    make: Any = serve.deployment  # (its overloads confuse mypy)
    replica = make(EngineReplica).options(
        name=REPLICA_DEPLOYMENT,
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": num_cpus, "runtime_env": {"env_vars": REPLICA_ENV}},
        # The engine queues and refuses (429) by itself; Ray must not cap it lower.
        max_ongoing_requests=100_000,
        max_queued_requests=-1,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=spec.grace_period_s + 5.0,
        request_router_config=router_config,
    )
    return replica.bind(spec)
