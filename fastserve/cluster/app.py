"""`fastserve serve --replicas N`: start-up, the main loop and shutdown of a fleet on Ray Serve.

Start-up binds the address (a taken port fails at once), joins Ray (a local cluster started
here, or `--ray-address` for an existing one), deploys N engine replicas
(`replica.EngineReplica`, each serving HTTP on a port of its own), waits until every replica
has reported its address, and serves the ingress (`ingress.FleetIngress`, routing with the
chosen policy) on the bound socket with uvicorn. SIGTERM or Ctrl-C stops taking
connections, lets Ray Serve stop the replicas gracefully (running requests get the grace
period), and leaves a cluster it joined running.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import ray
import uvicorn
from ray import serve
from ray.serve.handle import DeploymentHandle

from fastserve.args import engine_config_from_args
from fastserve.cluster.ingress import FleetIngress, RouteHints
from fastserve.cluster.metrics import FleetMetrics, samples_of
from fastserve.cluster.proxy import ReplicaClient
from fastserve.cluster.replica import REPLICA_DEPLOYMENT, ReplicaSpec, deployment
from fastserve.cluster.router import METRICS_KEY, ROUTER_NAMES, ReplicaTable, RouterBoard
from fastserve.fleet.policies import make_router
from fastserve.logs import configure_logging
from fastserve.model.make_model import resolve_model_path
from fastserve.model.tokenizer import Tokenizer
from fastserve.server.cli import start_serving
from fastserve.server.http_limits import HTTPLimits, fit_open_files, limited_protocol

logger = logging.getLogger(__name__)

# The routers that read prompts (the others never look at a RouteRequest).
_PROMPT_ROUTERS = ("fastserve", "prefix-affinity")
_QUIET_SERVE_LOGS = {"enable_access_log": False, "log_level": "WARNING"}
# Set for a local cluster started here (the processes Ray starts inherit them); an existing
# cluster (`--ray-address`) keeps its own settings.
_LEAN_RAY_ENV = {
    # Ray's own metrics (Prometheus export through the metrics agent): the fleet's /metrics
    # is fastserve's, and the recording costs every process, the ingress's handle included.
    "RAY_enable_metrics_collection": "0",
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage-stats reporting
    # Serve's controller wakes every 0.1 s by default, ~30 ms of CPU per second on an idle
    # fleet; a replica's death is still seen by its health check (every 2 s) or at once by
    # the ingress's handle.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}
# How long start-up waits, once Ray Serve has the replicas running, for each to report the
# address of its HTTP server (its first routing stats, one stats period after it started).
_ADDRESS_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class FleetOptions:
    """The fleet's side of `fastserve serve --replicas N` (HTTP options as one server's)."""

    num_replicas: int
    host: str
    port: int
    served_model_name: str | None
    api_key: str | None
    max_body_bytes: int
    grace_period_s: float
    log_level: str
    access_log: bool
    ray_address: str | None = None  # None: start a local Ray cluster for this fleet
    router: str = "fastserve"
    app_name: str = "fastserve"  # the Ray Serve application (one fleet per name in a cluster)
    stats_period_s: float = 0.5  # how often replicas send the router their stats
    cpus_per_replica: float = 1.0  # Ray's CPU reservation for each replica
    tool_call_parser: str = "auto"  # as one server's
    reasoning_parser: str = "auto"  # as one server's
    trust_request_chat_template: bool = False  # as one server's
    metrics_require_key: bool = False  # as one server's
    http_limits: HTTPLimits = field(default_factory=HTTPLimits)  # as one server's
    stream_batch_ms: float = 50.0  # a stream's chunks reach the ingress once per this, at most

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"replicas: must be at least 1, got {self.num_replicas}")
        if self.router not in ROUTER_NAMES:
            raise ValueError(f"router: unknown router {self.router!r}; choose one of "
                             f"{', '.join(ROUTER_NAMES)}")
        if not 0 <= self.stream_batch_ms <= 1000:
            raise ValueError(f"stream_batch_ms: must be within 0-1000 (ms), got "
                             f"{self.stream_batch_ms}")
        if self.stats_period_s <= 0:
            raise ValueError(f"stats_period_s must be > 0, got {self.stats_period_s}")
        if self.metrics_require_key and self.api_key is None:
            raise ValueError("--metrics-require-key needs a key: --api-key or $FASTSERVE_API_KEY")


class Fleet:
    """A running fleet: Ray joined, the replicas deployed, the ingress app built."""

    def __init__(self, opts: FleetOptions, engine_args: argparse.Namespace) -> None:
        self.opts = opts
        config = engine_config_from_args(engine_args)
        if config.model.model is not None and not os.path.isdir(config.model.model):
            # Checked here: a replica failing to start is retried by Ray, then reported
            # as a failed deployment, a worse message than one server's.
            raise ValueError(f"model: {config.model.model!r} is not a model directory")
        if config.lora.allow_runtime_lora_updating:
            # NOTE: the ingress forwards a call to one replica; every replica would need it.
            raise ValueError("allow_runtime_lora_updating: not with --replicas (an adapter "
                             "loaded while serving would reach one replica); give the "
                             "adapters with --lora-modules")
        self.name = opts.served_model_name or config.model.model or "tiny"
        self.started_ray = False
        if not ray.is_initialized():
            local = opts.ray_address is None
            if local:
                # Ray runs its workers at niceness 15 unless told otherwise: on a busy
                # machine the replicas would yield to everything else, the ingress included.
                os.environ.setdefault("RAY_worker_niceness", "0")
                # Nor start idle task workers up front: the fleet runs actors only.
                os.environ.setdefault("RAY_enable_worker_prestart", "0")
                # A lean cluster: every idle millisecond of Ray's own processes is taken
                # from the replicas on a small machine (`_LEAN_RAY_ENV`).
                for name, value in _LEAN_RAY_ENV.items():
                    os.environ.setdefault(name, value)
            ray.init(
                address=opts.ray_address, namespace="fastserve", include_dashboard=False,
                # A local cluster gets room for every replica, whatever the core count.
                num_cpus=max(os.cpu_count() or 1, int(opts.num_replicas * opts.cpus_per_replica))
                if local else None,
                logging_level=logging.WARNING,
            )
            self.started_ray = True
        serve.start(proxy_location="Disabled", logging_config=_QUIET_SERVE_LOGS)
        spec = ReplicaSpec(engine_args=engine_args, served_model_name=self.name,
                           api_key=opts.api_key, max_body_bytes=opts.max_body_bytes,
                           grace_period_s=opts.grace_period_s,
                           tool_call_parser=opts.tool_call_parser,
                           reasoning_parser=opts.reasoning_parser,
                           trust_request_chat_template=opts.trust_request_chat_template,
                           metrics_require_key=opts.metrics_require_key,
                           stream_batch_s=opts.stream_batch_ms / 1000,
                           # NOTE: a cluster of its own is this machine's: the replicas listen
                           # on loopback. Joined (`--ray-address`), each listens on its node's
                           # IP address, which the ingress on another machine can reach.
                           host="127.0.0.1" if self.started_ray and opts.ray_address is None
                           else None)
        app = deployment(spec, opts.num_replicas, opts.cpus_per_replica, opts.stats_period_s)
        serve.run(app, name=opts.app_name, route_prefix=None, logging_config=_QUIET_SERVE_LOGS)
        self.hints = None
        if opts.router in _PROMPT_ROUTERS:
            self.hints = RouteHints(Tokenizer(resolve_model_path(config.model.model),
                                              config.model.chat_template),
                                    config.cache.block_size,
                                    frozenset(name for name, _ in config.lora.adapters))
        self.metrics = FleetMetrics(self._replica_samples)
        self.handle: DeploymentHandle | None = None
        self.client: ReplicaClient | None = None

    async def ingress(self) -> FleetIngress:
        """The ingress app, once every replica has reported its address; called on the event
        loop that serves it. The deployment handle is never called: the request router Ray
        builds in it, on this loop, keeps the replicas and their stats (`RouterBoard`)."""
        self.handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, self.opts.app_name)
        self.handle._init(_run_router_in_separate_loop=False)
        table = ReplicaTable(self.opts.app_name, make_router(self.opts.router))
        deadline = time.monotonic() + _ADDRESS_TIMEOUT_S
        while True:
            table.refresh()
            if len(table.urls) >= self.opts.num_replicas:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(table.urls)} of {self.opts.num_replicas} replicas "
                                   f"reported their address within {_ADDRESS_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.1)
        self.client = ReplicaClient(sender=table.sender)
        return FleetIngress(table, self.client, self.metrics, self.hints,
                            self.opts.max_body_bytes, max_attempts=self.opts.num_replicas + 3,
                            metrics_key=self.opts.api_key if self.opts.metrics_require_key
                            else None)

    def _replica_samples(self) -> dict[str, Any]:
        return {rid: samples_of(stats, METRICS_KEY)
                for rid, stats in RouterBoard.replica_stats(self.opts.app_name).items()}

    def close(self) -> None:
        """Stop the replicas (Ray Serve gives each its graceful stop); leave Ray if we
        started it."""
        try:
            serve.delete(self.opts.app_name)
        finally:
            if self.started_ray:  # (Serve's controller goes with the cluster)
                ray.shutdown()


def serve_fleet(opts: FleetOptions, engine_args: argparse.Namespace) -> int:
    """Start-up, main loop, shutdown. Returns the process exit code."""
    configure_logging(opts.log_level)
    sock = _bind(opts.host, opts.port)
    fit_open_files(opts.http_limits.max_connections)
    fleet: Fleet | None = None
    try:
        where = opts.ray_address or "a local Ray cluster"
        print(f"fastserve: starting {opts.num_replicas} replicas on {where} "
              f"(router: {opts.router}) ...", flush=True)
        fleet = Fleet(opts, engine_args)
        return _run(_main_loop(fleet, sock))
    finally:
        sock.close()
        if fleet is not None:
            fleet.close()
        print("fastserve: shut down", flush=True)


async def _main_loop(fleet: Fleet, sock: socket.socket) -> int:
    opts = fleet.opts
    server = uvicorn.Server(uvicorn.Config(
        await fleet.ingress(), log_level=opts.log_level, access_log=opts.access_log, lifespan="off",
        http=limited_protocol(opts.http_limits),
        timeout_graceful_shutdown=opts.grace_period_s + 5.0))  # type: ignore[arg-type]
    # As `fastserve serve`: uvicorn re-raises the signal after serving; a no-op handler then
    # makes a graceful stop exit 0.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serving, url = await start_serving(server, sock)
        if url is not None:
            print(f"fastserve: serving {fleet.name!r} with {opts.num_replicas} replicas at "
                  f"{url}/v1 (health: /health, metrics: /metrics)", flush=True)
        await serving
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if fleet.client is not None:
            await fleet.client.close()
        if fleet.handle is not None:  # its router lives on this loop: stop it here
            await fleet.handle.shutdown_async()
    return 0 if server.started else 1


def _run(main: Coroutine[Any, Any, int]) -> int:
    """The ingress's event loop, on uvloop when installed (as `fastserve serve`'s): with plain
    asyncio, a kept-alive client saw each response's body ~40 ms after its headers."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (uvicorn serves on it once the replicas are up)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _ignore(sig: int, frame: FrameType | None) -> None:
    """Stands in for the default handler while uvicorn owns the signals."""
