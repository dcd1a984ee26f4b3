"""`fastserve bench`: compare scheduling policies on one workload, optionally over a sweep."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from fastserve.args import add_engine_args, engine_config_from_args
from fastserve.bench.fleet import fleet_workload, run_fleet
from fastserve.bench.report import (
    format_sweep_table,
    format_table,
    plot_bars,
    plot_sweep,
    require_pyplot,
    write_json,
)
from fastserve.bench.runner import EXECUTORS, WorkloadSpec, parse_value, run_policies
from fastserve.bench.workloads import WorkItem, offered_load
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.fleet import ROUTERS
from fastserve.sim.fleet import DEFAULT_STATS_PERIOD_S
from fastserve.sim.profiles import A100_13B

# The simulator's Zipf workload where a flag does not say otherwise: heavy-tailed lengths and
# bursty arrivals at load 0.9 on the A100-13B model, where the scheduler's choice matters
# (benchmarks/paper/tail_grid.py: skip-join-mlfq's mean JCT ~2x lower than FCFS's there).
# Poisson arrivals of light-tailed lengths at low load leave every policy the same order.
SIM_ZIPF_DEFAULTS: dict[str, Any] = {
    "cv": 8.0, "zipf_theta": 1.2, "max_input_len": 2048, "max_output_len": 2048, "load": 0.9}

# Workload flags: (flag, type, help). Each maps onto the WorkloadSpec field of the same name.
_WORKLOAD_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("num-requests", int, "jobs to run (zipf default 1000; trace default: the whole window)"),
    ("rate", float, "zipf: mean arrival rate, requests/s (default 2)"),
    ("cv", float, "zipf: coefficient of variation of inter-arrival gaps (default 1 = Poisson)"),
    ("zipf-theta", float, "zipf: length skew, larger = more short jobs (default 0.9)"),
    ("max-input-len", int, "longest prompt (zipf default 512; caps a trace)"),
    ("max-output-len", int, "longest output (zipf default 512; caps a trace)"),
    ("load", float, "scale arrivals to this offered load (work / capacity at max batch size; "
                    "needs --profile; default: the rate as given)"),
    ("window-start-s", float, "trace: first second to replay (default 0)"),
    ("window-s", float, "trace: seconds to replay (default: to the end)"),
    ("time-scale", float, "trace: multiply arrival times (2 = half the rate; default 1)"),
    ("length-scale", float, "trace: multiply token lengths (default 1)"),
    ("token-scale", float, "mooncake: divide lengths and the 512-token block by this "
                           "(16: 32-token blocks; default 1)"),
    ("sample-conversations", int, "mooncake: keep 1 conversation in N, whole (default 1)"),
    ("max-tokens", str, "what clients send as max_tokens: length (the true output length), "
                        "pow2 (the power of two above it, doubled for half the jobs) or max "
                        "(the longest output, as a client asking for the context); default "
                        "length. Orca reserves KV for max_tokens"),
)
_SWEEPABLE = tuple(flag for flag, _, _ in _WORKLOAD_FLAGS) + ("seed",)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "bench",
        help="compare scheduling policies on one workload (simulated or real)",
        description=__doc__,
    )
    p.add_argument("--executor", choices=EXECUTORS, default="sim",
                   help="sim: the production scheduler on a virtual clock and --profile's cost "
                        "model; real: requests on the wall clock through AsyncLLM (default: sim)")
    p.add_argument("--policies", default="fcfs,skip-join-mlfq",
                   help="comma-separated policies; options per policy as "
                        "name:key=value, e.g. skip-join-mlfq:mlfq-variant=paper "
                        "(default: fcfs,skip-join-mlfq)")
    p.add_argument("--workload", default="zipf", help="zipf, mooncake:PATH (JSONL with hash_ids) or trace:PATH (CSV "
                   "arrival_s,input_tokens,output_tokens) (default: zipf)")
    group = p.add_argument_group("workload options")
    for flag, kind, help_ in _WORKLOAD_FLAGS:
        group.add_argument(f"--{flag}", type=kind, default=None, help=help_)
    p.add_argument("--sweep", default=None,
                   help=f"PARAM=V1,V2,...: rerun every policy per value; PARAM is one of "
                        f"{', '.join(_SWEEPABLE)} (default: no sweep)")
    fleet = p.add_argument_group("fleet (sim): replicas behind a router")
    fleet.add_argument("--replicas", type=int, default=1,
                       help="replicas of the engine, each with its own scheduler and KV pool; "
                            "--load is then per replica (default 1: no router)")
    fleet.add_argument("--router", default=None,
                       help=f"comma-separated routers, one fleet run each: {', '.join(ROUTERS)}; "
                            "options as name:key=value (default with --replicas > 1: fastserve)")
    fleet.add_argument("--stats-period-s", type=float, default=DEFAULT_STATS_PERIOD_S,
                       help="how often each replica reports its stats to the router "
                            f"(default {DEFAULT_STATS_PERIOD_S})")
    fleet.add_argument("--record-trace", default=None,
                       help="write the first router's recorded trace (JSON) here (default: none)")
    p.add_argument("--out", default=None, help="the results JSON file to write (default: none)")
    p.add_argument("--plot", default=None,
                   help="write a PNG here: average and p99 JCT per policy (per router and policy "
                        "with --replicas; against the swept value with --sweep); needs "
                        "matplotlib, the `plot` extra (default: no plot)")
    add_engine_args(p)  # includes --seed, which also seeds the workload
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    cost = CostModel.from_json(config.profile_path) if config.profile_path else None
    if args.executor == "sim" and cost is None:
        print("bench: no --profile given; simulating LLaMA-2-13B on one A100 "
              "(fastserve.sim.profiles.A100_13B)", file=sys.stderr)
        cost = A100_13B
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ValueError("--policies must name at least one policy")
    spec = _workload_spec(args)
    if args.plot:
        require_pyplot()  # refused now, not after the whole run
    if args.replicas > 1 or args.router:
        return _run_fleet_bench(args, config, cost, policies, spec)
    # NOTE: without a sweep there is one run, keyed "" in `sweep` below.
    param, values = _parse_sweep(args.sweep) if args.sweep else (None, list[str | None]([None]))
    progress = sys.stderr.isatty()
    batch = config.scheduler.max_batch_size

    sweep: dict[str, dict[str, dict[str, float]]] = {}
    loads: dict[str, float | None] = {}
    for value in values:
        override: dict[str, Any] = {} if param is None else {param: parse_value(str(value))}
        run_spec = dataclasses.replace(spec, **override)
        workload = run_spec.build(cost, batch)
        key = value if value is not None else ""
        loads[key] = _offered_load(workload, cost, batch)
        print(f"{_describe(workload, loads[key])}" + (f"  [{param}={value}]" if param else ""))
        sweep[key] = run_policies(
            workload, policies, config, args.executor, cost,
            config.cache.num_device_blocks, run_spec.seed, progress,
        )
        if param is None:
            print(format_table(sweep[key]))
            print(format_ratios(sweep[key]))

    meta = _config_json(args, config, cost, spec, policies, param, values, loads)
    data = {"config": meta, "results": sweep[""] if param is None else sweep}
    if param is not None:
        print(format_sweep_table(param, sweep, "jct_mean"))
        print(format_sweep_table(param, sweep, "jct_p99"))
    if args.plot:
        if param is None:
            plot_bars(args.plot, sweep[""], title=args.workload)
        else:
            plot_sweep(args.plot, param, sweep, title=f"{args.workload}, {args.executor}")
    if args.out:
        write_json(args.out, data)
    written = [f for f in (args.out, args.plot) if f]
    if written:
        print("wrote " + " and ".join(written))
    return 0


def _run_fleet_bench(args: argparse.Namespace, config: EngineConfig, cost: CostModel | None,
                     policies: list[str], spec: WorkloadSpec) -> int:
    """`--replicas N --router R`: each router in front of a fresh simulated fleet."""
    if args.executor != "sim" or cost is None:
        raise ValueError("--replicas and --router need --executor sim")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.sweep:
        raise ValueError("--sweep is not supported with --replicas / --router")
    routers = [r.strip() for r in (args.router or "fastserve").split(",") if r.strip()]
    batch = config.scheduler.max_batch_size
    workload = dataclasses.replace(spec, load=None).build(cost, batch)
    if spec.load is not None:
        workload = fleet_workload(workload, spec.load, args.replicas, cost, batch)
    load = _offered_load(workload, cost, batch)
    print(_describe(workload, None if load is None else load / args.replicas)
          + f" per replica, {args.replicas} replicas")
    results = run_fleet(workload, policies, routers, config, cost, args.replicas,
                        config.cache.num_device_blocks, spec.seed, args.stats_period_s,
                        sys.stderr.isatty(), args.record_trace)
    print(format_table(results))
    meta = _config_json(args, config, cost, spec, policies, None, [None], {"": load})
    meta.update(replicas=args.replicas, routers=routers, stats_period_s=args.stats_period_s)
    if args.out:
        write_json(args.out, {"config": meta, "results": results})
    if args.plot:
        plot_bars(args.plot, results,
                  title=f"{args.workload}, {args.replicas} replicas")
    written = [f for f in (args.out, args.plot, args.record_trace) if f]
    if written:
        print("wrote " + " and ".join(written))
    return 0


def _workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    given = {
        flag.replace("-", "_"): getattr(args, flag.replace("-", "_"))
        for flag, _, _ in _WORKLOAD_FLAGS
        if getattr(args, flag.replace("-", "_")) is not None
    }
    if args.executor == "sim" and args.workload == "zipf":
        unset = {k: v for k, v in SIM_ZIPF_DEFAULTS.items() if k not in given}
        if "rate" in given:  # a rate given is the rate meant, not one to rescale
            unset.pop("load", None)
        given.update(unset)
    return WorkloadSpec(kind=args.workload, seed=args.seed or 0, **given)


def format_ratios(results: dict[str, dict[str, float]]) -> str:
    """Each policy's mean and p99 JCT against the first policy's (the baseline): how many
    times lower (above 1: better than the baseline)."""
    names = list(results)
    if len(names) < 2:
        return ""
    base = results[names[0]]
    return "\n".join(
        f"{names[0]} / {p}: mean JCT {base['jct_mean'] / results[p]['jct_mean']:.2f}x, "
        f"p99 JCT {base['jct_p99'] / results[p]['jct_p99']:.2f}x, "
        f"p99 slowdown {base['slowdown_p99'] / results[p]['slowdown_p99']:.2f}x"
        for p in names[1:])


def _parse_sweep(text: str) -> tuple[str, list[str | None]]:
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or name not in _SWEEPABLE:
        raise ValueError(f"--sweep must be PARAM=V1,V2,... with PARAM one of {_SWEEPABLE}, got {text!r}")
    items: list[str | None] = [v.strip() for v in values.split(",") if v.strip()]
    if not items:
        raise ValueError(f"--sweep {name} needs at least one value")
    return name.replace("-", "_"), items


def _offered_load(workload: list[WorkItem], cost: CostModel | None, batch: int) -> float | None:
    if cost is None or len(workload) < 2 or workload[-1].arrival_s <= workload[0].arrival_s:
        return None
    return offered_load(workload, cost, batch)


def _describe(workload: list[WorkItem], load: float | None) -> str:
    n = len(workload)
    span = workload[-1].arrival_s - workload[0].arrival_s
    mean_in = sum(w.input_len for w in workload) / n
    mean_out = sum(w.output_len for w in workload) / n
    text = f"{n} requests over {span:.1f} s, mean input {mean_in:.0f}, mean output {mean_out:.0f}"
    return text + (f", offered load {load:.2f}" if load is not None else "")


def _config_json(
    args: argparse.Namespace,
    config: EngineConfig,
    cost: CostModel | None,
    spec: WorkloadSpec,
    policies: list[str],
    param: str | None,
    values: list[str | None],
    loads: dict[str, float | None],
) -> dict[str, Any]:
    return {
        "executor": args.executor,
        "policies": policies,
        "workload": dataclasses.asdict(spec),
        "engine": dataclasses.asdict(config),
        "cost_model": dataclasses.asdict(cost) if cost is not None else None,
        "num_device_blocks": config.cache.num_device_blocks,  # None = ample (sim)
        "sweep": {"param": param, "values": values} if param else None,
        "offered_load": loads if param else loads[""],
    }
