"""Fleet routers side by side in the simulator: 16 replicas (default), load 0.9 per replica,
on the Mooncake synthetic trace and on a heavy-tailed bursty trace (Zipf 1.2, CV 4).

Every replica runs the production skip-join MLFQ scheduler over the A100 13B cost model
(`fastserve.sim.profiles.A100_13B`) with its own KV pool and prefix cache; each router sees
the replicas' stats every 0.1 s plus its own record of what it sent since. Prints, per trace,
mean and p99 JCT per router and FastServe's router's gain over each baseline (baseline / ours).

    python benchmarks/fleet/fleet_sim.py            # both traces, all routers (~10 min on 1 core)
    python benchmarks/fleet/fleet_sim.py --quick    # a quarter of the jobs
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fastserve.args import engine_config
from fastserve.bench.fleet import fleet_workload, run_fleet
from fastserve.bench.workloads import mooncake_workload, zipf_workload
from fastserve.request import WorkItem
from fastserve.sim.profiles import A100_13B

MOONCAKE = Path("/work/shared/traces/mooncake_synthetic.jsonl")
ROUTERS = ("fastserve", "pow2", "prefix-affinity", "round-robin")
BASELINES = ("pow2", "prefix-affinity", "round-robin")


def traces(args: argparse.Namespace) -> dict[str, list[WorkItem]]:
    n = args.num_requests // (4 if args.quick else 1)
    out = {}
    if args.mooncake.exists():
        # Lengths and the 512-token block divided by 16 (32-token blocks): the same share of
        # every prompt is a repeated prefix, at a size the simulator runs in minutes.
        out["mooncake"] = mooncake_workload(args.mooncake, num_requests=n, token_scale=16)
    else:
        print(f"skipping the Mooncake trace: {args.mooncake} not found")
    out["zipf1.2-cv4"] = zipf_workload(n, rate=1.0, cv=4.0, theta=1.2, max_input_len=512,
                                       max_output_len=1024, seed=args.seed)
    return out


def alone_s(w: WorkItem) -> float:
    """A job's JCT alone on an idle replica with nothing cached: no router can do better
    without prefix hits (with them, its prefill shrinks)."""
    cost = A100_13B
    return cost.prefill_s(w.input_len) + sum(
        cost.iteration_s(0, 1, w.input_len + k) for k in range(1, w.output_len))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--load", type=float, default=0.9, help="offered load per replica")
    p.add_argument("--num-requests", type=int, default=4000, help="jobs per trace")
    p.add_argument("--blocks", type=int, default=2000,
                   help="device KV blocks (16 tokens) per replica")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--stats-period-s", type=float, default=0.1)
    p.add_argument("--mooncake", type=Path, default=MOONCAKE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traces", default="mooncake,zipf1.2-cv4")
    p.add_argument("--quick", action="store_true", help="a quarter of the jobs")
    args = p.parse_args()

    cost = A100_13B
    config = engine_config(policy="skip-join-mlfq", num_device_blocks=args.blocks)
    batch = config.scheduler.max_batch_size
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    print(f"{args.replicas} replicas, skip-join-mlfq, batch {batch}, {args.blocks} KV blocks "
          f"each, A100 13B cost model, load {args.load} per replica, stats every "
          f"{args.stats_period_s} s, seed {args.seed}")
    table = []
    for name, work in traces(args).items():
        if name not in args.traces.split(","):
            continue
        work = fleet_workload(work, args.load, args.replicas, cost, batch)
        t0 = time.perf_counter()
        res = run_fleet(work, ["skip-join-mlfq"], routers, config, cost, args.replicas,
                        args.blocks, args.seed, args.stats_period_s)
        print(f"\n{name}: {len(work)} jobs over {work[-1].arrival_s - work[0].arrival_s:.1f} s "
              f"({time.perf_counter() - t0:.0f} s to simulate)")
        print(f"{'router':<18}{'mean JCT s':>11}{'p99 JCT s':>11}{'TTFT s':>9}"
              f"{'hit rate':>10}{'busy max/mean':>15}{'done':>6}")
        for r in routers:
            m = res[r]
            print(f"{r:<18}{m['jct_mean']:>11.3f}{m['jct_p99']:>11.3f}{m['ttft_mean']:>9.3f}"
                  f"{m['prefix_hit_rate']:>10.2f}{m['busy_max_over_mean']:>15.2f}"
                  f"{int(m['num_finished']):>6}")
        bound = sum(alone_s(w) for w in work) / len(work)
        print(f"{'(no-wait bound)':<18}{bound:>11.3f}   each job alone on a replica, no cache")
        if not any(m["prefix_hit_rate"] > 0 for m in res.values()):
            # With no prefix hit anywhere no router beats the bound, so a baseline's mean over
            # the bound is the most any router can gain on it (on this trace, at this load).
            for b in BASELINES:
                if b in res:
                    print(f"  headroom over {b}: {res[b]['jct_mean'] / bound:.2f}x "
                          "(its mean JCT / the no-wait bound)")
        if "fastserve" in res:
            ours = res["fastserve"]
            for b in BASELINES:
                if b in res:
                    table.append((name, b, res[b]["jct_mean"] / ours["jct_mean"],
                                  res[b]["jct_p99"] / ours["jct_p99"]))
    if table:
        print("\nfastserve's gain: baseline's JCT / fastserve's (> 1: fastserve lower)")
        print(f"{'trace':<14}{'baseline':<18}{'mean':>7}{'p99':>7}")
        for name, b, mean, p99 in table:
            print(f"{name:<14}{b:<18}{mean:>7.2f}{p99:>7.2f}")


if __name__ == "__main__":
    main()
