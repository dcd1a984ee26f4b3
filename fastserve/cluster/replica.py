"""One engine replica of the fleet: a Ray Serve deployment serving the single server's app
over HTTP.

Each replica builds the engine (`AsyncLLM`) and the same FastAPI app `fastserve serve` serves
(`build_app`), and serves it with its own uvicorn on a port of its own (`ReplicaHTTP`, on a
thread with its own event loop, as one server serves it): the fleet's ingress streams each
response from there directly, so requests, validation, errors, streams and metrics are one
server's. Ray Serve places the replicas, restarts one whose process dies or whose
`check_health` fails, and collects `record_routing_stats`, which also carry the replica's
address to the ingress.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import uvicorn
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.types import ASGIApp, Receive, Scope, Send

from fastserve.args import engine_config_from_args
from fastserve.cluster.asgi import BatchedStreams
from fastserve.cluster.metrics import replica_samples
from fastserve.cluster.proxy import SENDER_HEADER
from fastserve.cluster.router import ADDRESS_KEY, METRICS_KEY, STATS_KEY, WATCHER_PATH
from fastserve.core.replica_stats import ReplicaStats
from fastserve.engine.async_llm import SENDER, AsyncLLM
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
    # (`asgi.BatchedStreams`): each write costs the replica and the ingress far more CPU than
    # a token's SSE bytes.
    stream_batch_s: float = 0.05
    # Where the replica's HTTP server listens and what it tells the ingress: None for the
    # node's IP address (the ingress may be on another machine), "127.0.0.1" for a cluster
    # started by the fleet on this machine.
    host: str | None = None


# The replica's HTTP server: its pending connections (a burst reaches it all at once), and
# how long it keeps an idle connection of the ingress (longer than the ingress keeps it:
# `proxy.ReplicaClient`, so that the ingress never reuses one the replica is closing).
_BACKLOG = 2048
_KEEP_ALIVE_S = 120.0
_START_TIMEOUT_S = 60.0


class ReplicaHTTP:
    """uvicorn serving `app` on `host` (a free port), on a thread with its own event loop
    (uvloop when installed, as `fastserve serve`'s), away from Ray Serve's loop."""

    def __init__(self, app: ASGIApp, host: str) -> None:
        self.sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host
                                         else socket.AF_INET, backlog=_BACKLOG)
        port = self.sock.getsockname()[1]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", log_config=None, access_log=False, lifespan="off",
            timeout_keep_alive=int(_KEEP_ALIVE_S), timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self._run, name="replica-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the replica's HTTP server did not start on {self.url}")
            time.sleep(0.01)

    @property
    def is_alive(self) -> bool:
        return self.thread.is_alive() and not self.server.should_exit

    async def stop(self) -> None:
        """Stop listening and close the connections (after the engine has drained)."""
        self.server.should_exit = True
        await asyncio.to_thread(self.thread.join, 10.0)

    def _run(self) -> None:
        loop: asyncio.AbstractEventLoop
        try:
            import uvloop
            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        try:
            # NOTE: off the main thread uvicorn installs no signal handlers: Ray owns them.
            loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        finally:
            loop.close()
            self.sock.close()


class SenderCounted:
    """`app`, with each request's sender (the ingress that forwarded it, by its
    `X-Fastserve-Ingress` header) known to the engine, which counts what it takes in from each
    (`AsyncLLM.admitted`, reported in the routing stats)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = next((v for k, v in scope.get("headers", ()) if k == SENDER_HEADER), None)
        if scope["type"] != "http" or sender is None:
            await self.app(scope, receive, send)
            return
        token = SENDER.set(sender.decode("latin-1"))
        try:
            await self.app(scope, receive, send)
        finally:
            SENDER.reset(token)


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
        host = spec.host or ray.util.get_node_ip_address()
        self.http = ReplicaHTTP(SenderCounted(BatchedStreams(self.app, spec.stream_batch_s)), host)
        logger.info("replica %s serving at %s (pid %d)", self.replica_id, self.http.url,
                    os.getpid())

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve asks every stats period: the router's `ReplicaStats`, this replica's
        `/metrics` samples and its address."""
        stats = await self._replica_stats()
        registry = self.app.state.serving.metrics.registry
        return {STATS_KEY: stats.to_json(), METRICS_KEY: replica_samples(registry),
                ADDRESS_KEY: self.http.url}

    async def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine loop or HTTP server died."""
        if not self.llm.is_healthy:
            raise RuntimeError(f"engine is not running: {self.llm.dead_reason}")
        if not self.http.is_alive:
            raise RuntimeError(f"the replica's HTTP server at {self.http.url} stopped")

    def pid(self) -> int:
        """This replica's process id (tests kill it)."""
        return os.getpid()

    async def __del__(self) -> None:
        """Ray Serve's graceful stop: let running requests finish within the grace period."""
        try:
            await self.llm.shutdown(grace_s=self.spec.grace_period_s)
        finally:
            await self.http.stop()

    async def _replica_stats(self) -> ReplicaStats:
        scheduler = self.llm.engine.scheduler
        # NOTE: read on the engine thread, between iterations (the scheduler is not
        # thread-safe); `_call` is AsyncLLM's way to run a function there.

        def snapshot() -> ReplicaStats:
            stats = scheduler.replica_stats(self.replica_id, time.time(),
                                            max_prefix_hashes=self.spec.max_prefix_hashes)
            # NOTE: on the same thread and turn as the snapshot: the count and the requests in
            # the snapshot agree.
            return dataclasses.replace(stats, admitted=self.llm.admitted())

        stats: ReplicaStats = await self.llm._call(snapshot)
        return stats


def deployment(spec: ReplicaSpec, num_replicas: int, num_cpus: float,
               stats_period_s: float) -> serve.Application:
    """The fleet's application: `num_replicas` engine replicas. The ingress routes among them
    itself (`router.ReplicaTable`); Ray Serve's request router in its handle only watches
    them (`router.ReplicaWatcher`)."""
    settings: dict[str, Any] = {
        "request_router_class": WATCHER_PATH,
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
