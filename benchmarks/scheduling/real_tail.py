"""The default scheduler against FCFS on the real engine: mean and p99 JCT at a high load.

The real engine (`AsyncLLM` on the wall clock, the `tiny` preset unless `--model`) serves one
heavy-tailed bursty workload (Zipf prompt and output lengths, Gamma arrivals of CV `--cv`)
scaled to `--load` of the engine's measured capacity, `--reps` times per policy, policies
interleaved on the same workload (a slow spell of the shared machine hits all alike). The
capacity is the engine's start-up profile times the scale its running calibration settles on
over a warm-up run of `--warmup-requests` (FCFS, same load): the machine as it is now, not
as it was when the profile was cached. Printed per policy and run: mean, p50, p99 JCT and
p99 slowdown (JCT over the job's time alone in that cost model); then the medians over the
runs, their ratios to the first policy's, and the simulator's prediction with the same cost
model beside them. The targets of issue #56: the default's mean JCT >= 2x lower than
FCFS's and its p99 JCT <= FCFS's.

    .venv/bin/python benchmarks/scheduling/real_tail.py [--num-requests 1000] [--load 0.95] \\
        [--policies fcfs,skip-join-mlfq] [--out results.json]

Defaults: tiny preset, batch 16, Zipf theta 1.5, CV 8, inputs <= 256, outputs <= 1024, float32,
one CPU thread (the client keeps the other core).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fastserve.args import engine_config
from fastserve.bench.metrics import alone_s, compute_metrics
from fastserve.bench.runner import WorkloadSpec, policy_config, run_real, run_sim
from fastserve.bench.workloads import offered_load
from fastserve.core.cost_model import CostModel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the tiny preset)")
    p.add_argument("--policies", default="fcfs,skip-join-mlfq",
                   help="comma-separated; the first is the baseline of the ratios")
    p.add_argument("--load", type=float, default=0.95,
                   help="offered load, a share of the start-up profile's capacity")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--zipf-theta", type=float, default=1.5)
    p.add_argument("--cv", type=float, default=8.0)
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=1, help="real runs per policy")
    p.add_argument("--warmup-requests", type=int, default=300,
                   help="requests of the warm-up run that measures the capacity (0 = take "
                        "the start-up profile as it is)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dry-run", action="store_true",
                   help="print the workload and the simulator's figures only")
    p.add_argument("--out", default=None, help="results JSON")
    args = p.parse_args()

    config = engine_config(model=args.model, max_batch_size=args.max_batch_size,
                           dtype="float32", num_threads=args.num_threads, seed=args.seed)
    cost = engine_cost(config)
    print(f"engine's start-up cost model: {cost}", flush=True)
    if args.warmup_requests > 0:
        warm = WorkloadSpec(num_requests=args.warmup_requests, cv=args.cv,
                            zipf_theta=args.zipf_theta, max_input_len=args.max_input_len,
                            max_output_len=args.max_output_len, load=args.load,
                            seed=args.seed + 1000).build(cost, args.max_batch_size)
        scale: list[float] = []
        asyncio.run(run_real(warm, policy_config(config, "fcfs"), args.seed, scale_out=scale))
        cost = cost.scaled(scale[0])
        print(f"warm-up ({len(warm)} requests): iterations take {scale[0]:.3f}x the start-up "
              f"profile; the capacity is that profile's / {scale[0]:.3f}", flush=True)
    spec = WorkloadSpec(num_requests=args.num_requests, cv=args.cv, zipf_theta=args.zipf_theta,
                        max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                        load=args.load, seed=args.seed)
    workload = spec.build(cost, args.max_batch_size)
    span = workload[-1].arrival_s - workload[0].arrival_s
    print(f"{len(workload)} requests over {span:.1f} s, offered load "
          f"{offered_load(workload, cost, args.max_batch_size):.3f} of the profile's capacity",
          flush=True)
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    sim = {pol: compute_metrics(run_sim(workload, policy_config(config, pol), cost),
                                len(workload)) for pol in policies}
    for pol in policies:
        m = sim[pol]
        print(f"  sim  {pol:16s} mean {m['jct_mean']:.3f} s p99 {m['jct_p99']:.3f} s "
              f"makespan {m['makespan_s']:.1f} s", flush=True)
    if args.dry_run:
        return 0
    runs: dict[str, list[dict[str, float]]] = {pol: [] for pol in policies}
    for rep in range(args.reps):
        for pol in policies:
            start = time.perf_counter()
            jobs = asyncio.run(run_real(workload, policy_config(config, pol), args.seed))
            if len(jobs) == len(workload):  # in workload order: price each job alone
                jobs = [dataclasses.replace(
                    j, alone_s=alone_s(w.input_len, j.num_output_tokens, cost))
                    for j, w in zip(jobs, workload, strict=True)]
            m = compute_metrics(jobs, len(workload))
            runs[pol].append(m)
            print(f"  real {pol:16s} rep {rep}: mean {m['jct_mean']:.3f} s p50 "
                  f"{m['jct_p50']:.3f} s p99 {m['jct_p99']:.3f} s, p99 slowdown "
                  f"{m['slowdown_p99']:.0f}, {m['num_finished']}/{len(workload)} finished, "
                  f"{time.perf_counter() - start:.0f} s wall", flush=True)
    real = {pol: {k: statistics.median(r[k] for r in runs[pol]) for k in runs[pol][0]}
            for pol in policies}
    base = policies[0]
    if args.reps > 1:
        print(f"\nper run, {base}'s mean / x's and x's p99 / {base}'s:")
        for pol in policies[1:]:
            print(f"  {pol}: " + ", ".join(
                f"{b['jct_mean'] / r['jct_mean']:.2f} / {r['jct_p99'] / b['jct_p99']:.3f}"
                for b, r in zip(runs[base], runs[pol], strict=True)))
    print(f"\nmedians over {args.reps} run(s)")
    print(f"policy | real mean s | real p99 s | {base}/x mean | x/{base} p99 | "
          f"sim mean s | sim p99 s | sim {base}/x mean | sim x/{base} p99")
    print(" | ".join(["---"] * 9))
    for pol in policies:
        r, s = real[pol], sim[pol]
        print(f"{pol} | {r['jct_mean']:.3f} | {r['jct_p99']:.3f} "
              f"| {real[base]['jct_mean'] / r['jct_mean']:.2f} "
              f"| {r['jct_p99'] / real[base]['jct_p99']:.3f} | {s['jct_mean']:.3f} "
              f"| {s['jct_p99']:.3f} | {sim[base]['jct_mean'] / s['jct_mean']:.2f} "
              f"| {s['jct_p99'] / sim[base]['jct_p99']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"args": vars(args), "cost_model": str(cost), "real_runs": runs, "real": real,
             "sim": sim}, indent=2))
        print(f"wrote {args.out}")
    return 0


def engine_cost(config: Any) -> CostModel:
    """The cost model the real engine starts with (its cached start-up profile, measured now
    if there is none)."""
    from fastserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    cost = engine.cost
    engine.shutdown()
    return cost


if __name__ == "__main__":
    sys.exit(main())
