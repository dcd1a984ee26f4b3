"""`fastserve serve --replicas N [--ray-address ADDR] [--router NAME]`: the fleet's flags on
the serve command. Without `--replicas` (or with 1 and no Ray address) `fastserve serve` is
the plain single server and Ray is never imported: Ray is the optional `fastserve-mlfq[cluster]`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

ROUTERS = ("fastserve", "prefix-affinity", "round-robin", "pow2")  # cluster.router.ROUTER_NAMES


def add_fleet_args(serve_parser: argparse.ArgumentParser) -> None:
    """Add the fleet flags to `fastserve serve`; a fleet is served when they ask for one."""
    g = serve_parser.add_argument_group("fleet options (Ray Serve; pip install 'fastserve-mlfq[cluster]')")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas on Ray Serve behind one endpoint "
                        "(default: one plain server, no Ray)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto': the one `ray start` made here) "
                        "instead of starting a local one (default: a local one)")
    g.add_argument("--router", choices=ROUTERS, default="fastserve",
                   help="how the fleet picks a replica: fastserve (MLFQ levels, KV room and "
                        "prefix hits), prefix-affinity, round-robin, or pow2 (Ray Serve's "
                        "default power of two choices) (default: fastserve)")
    g.add_argument("--cpus-per-replica", type=float, default=None,
                   help="Ray CPUs reserved per replica (default: --num-threads, or 1)")
    g.add_argument("--stream-batch-ms", type=float, default=50.0,
                   help="a replica sends a stream's tokens to the ingress at most once per "
                        "this many ms after the first (one write for all the tokens made "
                        "meanwhile); 0: as soon as each is made (default: 50)")
    single: Callable[[argparse.Namespace], int] = serve_parser.get_default("func")

    def serve(args: argparse.Namespace) -> int:
        if args.replicas is None and args.ray_address is None:
            return single(args)
        return _serve_fleet(args)

    serve_parser.set_defaults(func=serve)


def _serve_fleet(args: argparse.Namespace) -> int:
    try:
        from fastserve.cluster.app import FleetOptions, serve_fleet
    except ImportError as exc:  # the optional extra is missing: say how to get it
        raise ValueError(f"--replicas needs Ray Serve ({exc}); "
                         "install it with: pip install 'fastserve-mlfq[cluster]'") from None
    from fastserve.server.http_limits import HTTPLimits

    opts = FleetOptions(
        num_replicas=args.replicas if args.replicas is not None else 1,
        host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_key=args.api_key, max_body_bytes=args.max_body_bytes,
        grace_period_s=args.grace_period_s, log_level=args.log_level,
        access_log=args.access_log, ray_address=args.ray_address, router=args.router,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        stream_batch_ms=args.stream_batch_ms,
        cpus_per_replica=args.cpus_per_replica or float(getattr(args, "num_threads", None) or 1),
        metrics_require_key=args.metrics_require_key,
        http_limits=HTTPLimits(header_timeout_s=args.http_header_timeout_s,
                               read_timeout_s=args.http_read_timeout_s,
                               max_connections=args.max_connections),
    )
    return serve_fleet(opts, args)
